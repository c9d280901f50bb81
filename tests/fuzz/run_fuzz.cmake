# One bounded fuzz pass (ctest label fuzz): cmake -DFUZZER=exe -DCORPUS=dir -DWORK=dir
# "-DARGS=-runs=N;..." -P run_fuzz.cmake. WORK is emptied and passed first, so the inputs
# libFuzzer adds go there; the committed CORPUS is only read. Crash inputs land in WORK too.
foreach(var FUZZER CORPUS WORK)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "run_fuzz.cmake: -D${var}=... is required")
  endif()
endforeach()
file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK}/new ${WORK}/artifacts)
execute_process(COMMAND ${FUZZER} ${ARGS} -artifact_prefix=${WORK}/artifacts/ ${WORK}/new ${CORPUS}
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  file(GLOB artifacts ${WORK}/artifacts/*)
  message(FATAL_ERROR "${FUZZER} failed (${rc}); reproduce with: ${FUZZER} ${artifacts}")
endif()
