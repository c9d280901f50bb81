# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 the distopt authors
# Included by the -P scripts that run commands given as `-- A ARGS... -- B ARGS...` (and
# `-- C ARGS...` for a third): sets `a`, `b` and `c` to the command lines.
set(a)
set(b)
set(c)
set(dashes 0)
math(EXPR last "${CMAKE_ARGC} - 1")
foreach(i RANGE 1 ${last})
  if(CMAKE_ARGV${i} STREQUAL "--")
    math(EXPR dashes "${dashes} + 1")
  elseif(dashes EQUAL 1)
    list(APPEND a "${CMAKE_ARGV${i}}")
  elseif(dashes EQUAL 2)
    list(APPEND b "${CMAKE_ARGV${i}}")
  elseif(dashes EQUAL 3)
    list(APPEND c "${CMAKE_ARGV${i}}")
  endif()
endforeach()
