# cpu_paths_agree: step-bits (AVX2 function clones) and step-bits-baseline (built with
# DISTOPT_NO_TARGET_CLONES) must print the same hashes. Each is first asked which path its
# update loops take here (`--path`); where both take the same one (Clang, -mavx2, a CPU
# without AVX2, not x86-64) there is nothing to compare, and the test says so and reports
# skipped (SKIP_REGULAR_EXPRESSION) instead of passing.
# -DA=(step-bits) -DB=(step-bits-baseline)
foreach(p A B)
  execute_process(COMMAND ${${p}} --path RESULT_VARIABLE rc OUTPUT_VARIABLE path_${p} OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${${p}} --path failed (${rc})")
  endif()
  string(REGEX MATCH "^[a-z0-9]+" kind_${p} "${path_${p}}")
endforeach()
message(STATUS "step-bits runs the ${path_A} path")
message(STATUS "step-bits-baseline runs the ${path_B} path")
if(kind_A STREQUAL kind_B)
  message(STATUS "cpu_paths_agree: skipped: both programs run the ${kind_A} path, so comparing them tests nothing")
  return()
endif()
execute_process(COMMAND ${A} RESULT_VARIABLE ra OUTPUT_VARIABLE oa)
execute_process(COMMAND ${B} RESULT_VARIABLE rb OUTPUT_VARIABLE ob)
if(NOT ra EQUAL 0 OR NOT rb EQUAL 0)
  message(FATAL_ERROR "a program failed: ${ra} ${rb}")
endif()
if(NOT oa STREQUAL ob)
  message(FATAL_ERROR "outputs differ:\n${A} (${kind_A}):\n${oa}\n${B} (${kind_B}):\n${ob}")
endif()
message(STATUS "the ${kind_A} and ${kind_B} paths give identical bits:\n${oa}")
