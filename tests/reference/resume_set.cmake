# distopt-replay --resume with --set: the loaded hyper-parameters take the values --set
# gives (a PyTorch loop sets a group's lr after load_state_dict). Saved after K steps with
# ARGS; resumed with ARGS and SET: the output differs from the uninterrupted run with ARGS
# (which a resume that dropped --set would write) and from the uninterrupted run with ARGS
# and SET (its first K steps used ARGS' values); resumed with ARGS alone it equals the first.
# -DREPLAY= -DTRACE= -DOUT=(prefix) -DARGS=(;-list) -DSET=(;-list) -DK=(step)
function(replay out)
  execute_process(COMMAND ${REPLAY} --trace ${TRACE} --out ${out} ${ARGS} ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE output
    ERROR_VARIABLE output)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "distopt-replay ${ARGN} failed (${rc}): ${output}")
  endif()
endfunction()
function(expect_same a b same)
  execute_process(COMMAND ${CMAKE_COMMAND} -E compare_files ${a} ${b} RESULT_VARIABLE rc)
  if(same AND NOT rc EQUAL 0)
    message(FATAL_ERROR "${b} differs from ${a}")
  elseif(NOT same AND rc EQUAL 0)
    message(FATAL_ERROR "${b} has the same bytes as ${a}: --set after --resume did nothing")
  endif()
endfunction()
set(dir ${OUT}.checkpoint)
file(REMOVE_RECURSE ${dir})
replay(${OUT}.plain.safetensors)
replay(${OUT}.set.safetensors ${SET})
replay(${OUT}.saved.safetensors --save-at ${K} ${dir})
replay(${OUT}.resumed.safetensors --resume ${dir})
replay(${OUT}.resumed_set.safetensors --resume ${dir} ${SET})
expect_same(${OUT}.plain.safetensors ${OUT}.resumed.safetensors TRUE)
expect_same(${OUT}.plain.safetensors ${OUT}.resumed_set.safetensors FALSE)
expect_same(${OUT}.set.safetensors ${OUT}.resumed_set.safetensors FALSE)
message(STATUS "--set after --resume changed the loaded hyper-parameters")
