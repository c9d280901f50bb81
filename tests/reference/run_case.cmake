# Runs distopt-replay on one golden trace and compares its output with PyTorch's.
# -DREPLAY= -DCOMPARE= -DTRACE= -DEXPECTED= -DOUT= -DARGS=(;-list) -DRTOL= -DATOL= [-DSKIP=a,b]
execute_process(COMMAND ${REPLAY} --trace ${TRACE} --out ${OUT} ${ARGS} RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "distopt-replay failed (${rc})")
endif()
execute_process(COMMAND ${COMPARE} ${OUT} ${EXPECTED} ${RTOL} ${ATOL} ${SKIP} RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "output differs from PyTorch beyond rtol ${RTOL}, atol ${ATOL}")
endif()
