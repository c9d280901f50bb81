# distopt-replay through another backend writes the same bytes as through the CPU executor.
# -DREPLAY= -DTRACE= -DOUT=(prefix) -DARGS=(;-list) -DBACKEND=(e.g. kokkos)
execute_process(COMMAND ${REPLAY} --trace ${TRACE} --out ${OUT}.cpu.safetensors ${ARGS} RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "distopt-replay --backend cpu failed (${rc})")
endif()
file(REMOVE ${OUT}.${BACKEND}.safetensors)
execute_process(COMMAND ${REPLAY} --trace ${TRACE} --out ${OUT}.${BACKEND}.safetensors ${ARGS} --backend ${BACKEND}
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "distopt-replay --backend ${BACKEND} failed (${rc})")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -E compare_files ${OUT}.cpu.safetensors ${OUT}.${BACKEND}.safetensors
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "distopt-replay --backend ${BACKEND} wrote different bytes from --backend cpu")
endif()
message(STATUS "--backend ${BACKEND}: the same bytes as --backend cpu")
