# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 the distopt authors
# Runs two programs that must train identically and compares what they print and log:
#   cmake -DLOG_A=<file> -DLOG_B=<file> -P compare.cmake -- PROGRAM_A ARGS... -- PROGRAM_B ARGS...
# Both must exit with 0; their stdout lines "epoch ..." and "test accuracy: ..." (without the
# epoch's seconds) must be equal, and so must the --log files LOG_A and LOG_B they write.
include(${CMAKE_CURRENT_LIST_DIR}/two_commands.cmake)
if(NOT a OR NOT b OR NOT DEFINED LOG_A OR NOT DEFINED LOG_B)
  message(FATAL_ERROR "compare.cmake: needs -DLOG_A, -DLOG_B and two commands, each after --")
endif()

# The lines of one run's stdout that must agree: per-epoch results and the final accuracy.
function(results_of cmd log out)
  file(REMOVE ${log})
  execute_process(COMMAND ${cmd} RESULT_VARIABLE rc OUTPUT_VARIABLE stdout ERROR_VARIABLE stderr)
  if(NOT rc STREQUAL "0")
    message(FATAL_ERROR "'${cmd}' exited with '${rc}'; stderr:\n${stderr}")
  endif()
  string(REGEX MATCHALL "(epoch [0-9]+/[0-9]+  train loss [^\n]*test accuracy [0-9.]+|test accuracy: [0-9.]+)"
         lines "${stdout}")
  if(NOT lines)
    message(FATAL_ERROR "'${cmd}' printed no results; stdout:\n${stdout}")
  endif()
  string(REPLACE ";" "\n" lines "${lines}")
  set(${out} "${lines}" PARENT_SCOPE)
endfunction()

results_of("${a}" ${LOG_A} results_a)
results_of("${b}" ${LOG_B} results_b)
message(STATUS "first run:\n${results_a}\nsecond run:\n${results_b}")
if(NOT results_a STREQUAL results_b)
  message(FATAL_ERROR "the runs print different results")
endif()
file(READ ${LOG_A} log_a)
file(READ ${LOG_B} log_b)
if(NOT log_a STREQUAL log_b)
  message(FATAL_ERROR "the per-step losses in ${LOG_A} and ${LOG_B} differ")
endif()
string(REGEX MATCHALL "\n" steps "${log_a}")
list(LENGTH steps steps)
message(STATUS "identical results and per-step losses (${steps} lines of log)")
