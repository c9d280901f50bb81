# Each of FILES, preprocessed as distopt::distopt's and distopt::core's users compile it,
# opens no nlohmann-json or xxHash header. -DCXX= -DINCLUDE= -DFILES=<comma list>
cmake_minimum_required(VERSION 3.25)
string(REPLACE "," ";" files "${FILES}")
foreach(file IN LISTS files)
  set(variants "" -DDISTOPT_COMPILED_CORE)
  if(file MATCHES "/src/core[.]cpp$")
    set(variants -DDISTOPT_COMPILED_CORE)  # compiled so only
  endif()
  foreach(core IN LISTS variants)
    execute_process(COMMAND ${CXX} -std=c++20 -I${INCLUDE} ${core} -x c++ -M ${file}
      RESULT_VARIABLE rc OUTPUT_VARIABLE deps ERROR_VARIABLE err)
    if(NOT rc EQUAL 0)
      message(FATAL_ERROR "${CXX} ${core} -M ${file} failed (${rc}):\n${err}")
    endif()
    string(REGEX MATCHALL "[^ \\\n]*(nlohmann|xxhash)[^ \\\n]*" found "${deps}")
    if(found)
      list(GET found 0 first)
      message(FATAL_ERROR "${file} ${core} opens ${first}: distopt::distopt would need that package")
    endif()
  endforeach()
  message(STATUS "${file}: no nlohmann-json, no xxHash")
endforeach()
