# Runs distopt-replay with ARGS and checks that it refuses: exit code 2 and exactly one
# line on stderr matching PATTERN. -DREPLAY= -DARGS=(;-list) -DPATTERN=
execute_process(COMMAND ${REPLAY} ${ARGS} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
string(STRIP "${err}" err)
if(NOT rc EQUAL 2)
  message(FATAL_ERROR "expected exit code 2, got '${rc}'; stderr: ${err}")
endif()
if(err MATCHES "\n")
  message(FATAL_ERROR "expected one line on stderr, got:\n${err}")
endif()
if(NOT err MATCHES "${PATTERN}")
  message(FATAL_ERROR "stderr '${err}' does not match '${PATTERN}'")
endif()
message(STATUS "refused as expected: ${err}")
