# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 the distopt authors
# Runs two trainings and checks that their test accuracies differ by at most MAX_GAP_E4
# (in units of 1e-4, the printed precision; 50 = half a point):
#   cmake -DMAX_GAP_E4=50 -P accuracy_gap.cmake -- PROGRAM_A ARGS... -- PROGRAM_B ARGS...
# Both must exit with 0 and print "test accuracy: X".
include(${CMAKE_CURRENT_LIST_DIR}/two_commands.cmake)
if(NOT a OR NOT b OR NOT DEFINED MAX_GAP_E4)
  message(FATAL_ERROR "accuracy_gap.cmake: needs -DMAX_GAP_E4 and two commands, each after --")
endif()

function(accuracy_of cmd out)
  execute_process(COMMAND ${cmd} RESULT_VARIABLE rc OUTPUT_VARIABLE stdout ERROR_VARIABLE stderr)
  if(NOT rc STREQUAL "0")
    message(FATAL_ERROR "'${cmd}' exited with '${rc}'; stderr:\n${stderr}")
  endif()
  if(NOT stdout MATCHES "test accuracy: ([0-9.]+)")
    message(FATAL_ERROR "'${cmd}' printed no test accuracy:\n${stdout}")
  endif()
  set(${out} ${CMAKE_MATCH_1} PARENT_SCOPE)
endfunction()

accuracy_of("${a}" acc_a)
accuracy_of("${b}" acc_b)
# CMake's math() is integer-only: compare in units of 1e-4 ("0.8835" -> 8835).
string(REGEX REPLACE "^0*\\.0*" "" ia "${acc_a}")
string(REGEX REPLACE "^0*\\.0*" "" ib "${acc_b}")
math(EXPR gap "${ia} - ${ib}")
if(gap LESS 0)
  math(EXPR gap "-(${gap})")
endif()
message("test accuracy ${acc_a} vs ${acc_b}: gap ${gap}e-4 (at most ${MAX_GAP_E4}e-4)")
if(gap GREATER MAX_GAP_E4)
  message(FATAL_ERROR "test accuracies ${acc_a} and ${acc_b} differ by more than ${MAX_GAP_E4}e-4")
endif()
