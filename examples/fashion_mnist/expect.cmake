# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 the distopt authors
# Runs a program and checks its exit code and output:
#   cmake -DRC=<code> -DPATTERN=<regex> [-DSTREAM=stdout|stderr] -P expect.cmake -- PROGRAM ARGS...
# With RC 2 (a refusal) stderr must also be exactly one line.
set(cmd)
set(after_dashes OFF)
math(EXPR last "${CMAKE_ARGC} - 1")
foreach(i RANGE 1 ${last})
  if(after_dashes)
    list(APPEND cmd "${CMAKE_ARGV${i}}")
  elseif(CMAKE_ARGV${i} STREQUAL "--")
    set(after_dashes ON)
  endif()
endforeach()
if(NOT cmd)
  message(FATAL_ERROR "expect.cmake: no command after --")
endif()
if(NOT DEFINED STREAM)
  set(STREAM stdout)
endif()

execute_process(COMMAND ${cmd} RESULT_VARIABLE rc OUTPUT_VARIABLE stdout ERROR_VARIABLE stderr)
string(STRIP "${${STREAM}}" text)
message(STATUS "exit code ${rc}; ${STREAM}:\n${text}")
if(NOT rc STREQUAL "${RC}")
  message(FATAL_ERROR "expected exit code ${RC}, got '${rc}'; stderr:\n${stderr}")
endif()
if(RC EQUAL 2 AND text MATCHES "\n")
  message(FATAL_ERROR "expected one line on stderr")
endif()
if(NOT text MATCHES "${PATTERN}")
  message(FATAL_ERROR "${STREAM} does not match '${PATTERN}'")
endif()
