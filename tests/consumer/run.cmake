# Installs distopt from BUILD into a fresh prefix, then configures, builds and runs the
# consumer project against it:
#  1. find_package(distopt) alone, where nlohmann-json cannot be found: distopt::distopt and
#     distopt::core build and run;
#  2. COMPONENTS: every component BUILD has, each program built; those that need no MPI
#     launch or GPU run (checkpoint, kokkos, muon);
#  3. a component BUILD lacks must fail to configure, naming it and the CMake option or
#     package that provides it; and checkpoint where nlohmann-json cannot be found, naming it.
# -DBUILD= -DSOURCE= -DWORK= -DCOMPONENTS=<comma list of BUILD's components> [-DCXX=<compiler>]
cmake_minimum_required(VERSION 3.25)
file(REMOVE_RECURSE ${WORK})
string(REPLACE "," ";" components "${COMPONENTS}")
set(common -DCMAKE_PREFIX_PATH=${WORK}/prefix)
if(CXX)
  list(APPEND common -DCMAKE_CXX_COMPILER=${CXX})
endif()

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    string(REPLACE ";" " " line "${ARGN}")
    message(FATAL_ERROR "consumer test: '${line}' failed (${rc})")
  endif()
endfunction()

# configure_fails(NAME PATTERN ARGS...): configuring with ARGS fails and says PATTERN.
function(configure_fails name pattern)
  execute_process(COMMAND ${CMAKE_COMMAND} -S ${SOURCE} -B ${WORK}/${name} ${common} ${ARGN}
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc EQUAL 0)
    message(FATAL_ERROR "consumer test: ${name}: configuring with ${ARGN} succeeded; it should fail")
  endif()
  string(REGEX REPLACE "[ \n]+" " " said "${out}${err}")  # CMake wraps the reason's lines
  if(NOT said MATCHES "${pattern}")
    message(FATAL_ERROR "consumer test: ${name}: the failure does not say '${pattern}':\n${out}${err}")
  endif()
  message(STATUS "consumer test: ${name}: refused as expected (${pattern})")
endfunction()

run(${CMAKE_COMMAND} --install ${BUILD} --prefix ${WORK}/prefix)

# 1. The base targets need threads only.
run(${CMAKE_COMMAND} -S ${SOURCE} -B ${WORK}/base ${common} -DCMAKE_BUILD_TYPE=Release -DCMAKE_DISABLE_FIND_PACKAGE_nlohmann_json=TRUE
  --no-warn-unused-cli)  # unused: the package did not look for nlohmann-json
run(${CMAKE_COMMAND} --build ${WORK}/base --parallel 2)
run(${WORK}/base/consumer)
run(${WORK}/base/consumer_core)

# 2. Every component of this installation, at -O0 (no build type): what is tested is the
# package, and the components' programs compile in half the time so.
if(components)
  string(REPLACE ";" "\\;" list "${components}")
  run(${CMAKE_COMMAND} -S ${SOURCE} -B ${WORK}/components ${common} "-DCOMPONENTS=${list}")
  run(${CMAKE_COMMAND} --build ${WORK}/components --parallel 2)
  if("checkpoint" IN_LIST components)
    run(${WORK}/components/consumer_checkpoint ${WORK}/components/checkpoint)
  endif()
  foreach(program kokkos muon)
    if(program IN_LIST components)
      run(${WORK}/components/consumer_${program})
    endif()
  endforeach()
endif()

# 3. What is missing is named, with what provides it.
set(option_cuda DISTOPT_ENABLE_CUDA)
set(option_nccl DISTOPT_ENABLE_NCCL)
set(option_kokkos DISTOPT_ENABLE_KOKKOS)
set(option_mpi DISTOPT_ENABLE_MPI)
set(missing "")
foreach(component cuda nccl kokkos mpi)
  if(NOT component IN_LIST components)
    set(missing ${component})
    break()
  endif()
endforeach()
if(missing)
  configure_fails(missing "component '${missing}' is not in this installation.*-D${option_${missing}}=ON"
    -DCOMPONENTS=${missing})
else()
  configure_fails(missing "component 'frobnicate' does not exist" -DCOMPONENTS=frobnicate)
endif()
if("checkpoint" IN_LIST components)
  configure_fails(no_json "component 'safetensors' needs nlohmann_json.*component 'checkpoint' needs component 'safetensors'"
    -DCOMPONENTS=checkpoint -DCMAKE_DISABLE_FIND_PACKAGE_nlohmann_json=TRUE)
endif()
