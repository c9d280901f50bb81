# distopt-replay on several ranks writes the same bytes as on one rank.
# -DREPLAY= -DTRACE= -DOUT=(prefix) -DARGS=(;-list) -DRANKS=(;-list of N for --ranks N)
# [-DMPIEXEC=(;-list: the launcher and its flags, then N and --comm mpi are added)]
# [-DEXTRA=(;-list of arguments for the multi-rank runs only, e.g. --tp;3; with MPIEXEC, N
#  is then the number of processes, DP x TP)]
execute_process(COMMAND ${REPLAY} --trace ${TRACE} --out ${OUT}.one.safetensors ${ARGS} RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "distopt-replay on one rank failed (${rc})")
endif()
foreach(n IN LISTS RANKS)
  set(out ${OUT}.${n}.safetensors)
  file(REMOVE ${out})
  if(MPIEXEC)
    execute_process(COMMAND ${MPIEXEC} ${n} ${REPLAY} --trace ${TRACE} --out ${out} ${ARGS} ${EXTRA} --comm mpi
      RESULT_VARIABLE rc)
  else()
    execute_process(COMMAND ${REPLAY} --trace ${TRACE} --out ${out} ${ARGS} ${EXTRA} --ranks ${n} RESULT_VARIABLE rc)
  endif()
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "distopt-replay on ${n} ranks failed (${rc})")
  endif()
  execute_process(COMMAND ${CMAKE_COMMAND} -E compare_files ${OUT}.one.safetensors ${out} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "distopt-replay on ${n} ranks wrote different bytes from one rank (${out})")
  endif()
endforeach()
