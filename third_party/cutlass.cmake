# third_party/cutlass.cmake -- resolve the CUTLASS headers (header-only use).
#
# Order:
#   1. -DCUTLASS_DIR=<dir>  or  $ENV{CUTLASS_DIR}: a CUTLASS source tree, or the
#      nvidia-cutlass wheel's `cutlass_library/source` folder (anything that has
#      include/cutlass/cutlass.h).
#   2. the installed pip package nvidia-cutlass (module `cutlass_library`), found
#      through the Python interpreter WITHOUT importing it (importlib.util.find_spec
#      of a top-level name does not execute the package).
# Result:
#   CUTLASS_ROOT          the resolved root (has include/cutlass/cutlass.h)
#   CUTLASS_INCLUDE_DIRS  <root>/include;<root>/tools/util/include
#   CUTLASS_VERSION       e.g. 4.2.0
#   target epifuse::cutlass (INTERFACE, header-only)
#
# Inputs: EPIFUSE_PYTHON (interpreter, optional), EPIFUSE_CUTLASS_VERSION (pin),
#         EPIFUSE_ALLOW_CUTLASS_VERSION_MISMATCH (option).

include_guard(GLOBAL)

set(EPIFUSE_CUTLASS_VERSION "4.2.0" CACHE STRING "CUTLASS version epifuse is pinned to")
set(EPIFUSE_CUTLASS_PIP_SPEC "nvidia-cutlass==4.2.0.0")
option(EPIFUSE_ALLOW_CUTLASS_VERSION_MISMATCH
       "Accept a CUTLASS whose version differs from EPIFUSE_CUTLASS_VERSION" OFF)
set(CUTLASS_DIR "" CACHE PATH
    "CUTLASS source tree or nvidia-cutlass wheel's cutlass_library/source (optional)")

function(_epifuse_cutlass_root_of dir out)
  # Accept <dir> itself, or <dir>/source (a cutlass_library package dir).
  set(${out} "" PARENT_SCOPE)
  foreach(cand "${dir}" "${dir}/source" "${dir}/cutlass_library/source")
    if(EXISTS "${cand}/include/cutlass/cutlass.h")
      get_filename_component(cand "${cand}" ABSOLUTE)
      set(${out} "${cand}" PARENT_SCOPE)
      return()
    endif()
  endforeach()
endfunction()

set(_cutlass_root "")
set(_cutlass_how "")
set(_cutlass_tried "")

# 1. explicit directory
set(_cutlass_hint "${CUTLASS_DIR}")
set(_cutlass_hint_name "-DCUTLASS_DIR")
if(NOT _cutlass_hint AND DEFINED ENV{CUTLASS_DIR} AND NOT "$ENV{CUTLASS_DIR}" STREQUAL "")
  set(_cutlass_hint "$ENV{CUTLASS_DIR}")
  set(_cutlass_hint_name "$CUTLASS_DIR (environment)")
endif()
if(_cutlass_hint)
  _epifuse_cutlass_root_of("${_cutlass_hint}" _cutlass_root)
  if(NOT _cutlass_root)
    message(FATAL_ERROR
      "epifuse: CUTLASS not found at ${_cutlass_hint_name}='${_cutlass_hint}' "
      "(no include/cutlass/cutlass.h there or in its source/ subfolder).\n"
      "Point -DCUTLASS_DIR=<cutlass checkout or .../cutlass_library/source> at a "
      "CUTLASS ${EPIFUSE_CUTLASS_VERSION} tree, or unset it and run "
      "`pip install ${EPIFUSE_CUTLASS_PIP_SPEC}`.")
  endif()
  set(_cutlass_how "${_cutlass_hint_name}")
endif()

# 2. the pip package, located without importing it
if(NOT _cutlass_root AND EPIFUSE_PYTHON)
  execute_process(
    COMMAND "${EPIFUSE_PYTHON}" -c
      "import importlib.util as u\ns = u.find_spec('cutlass_library')\nprint(list(s.submodule_search_locations)[0] if s and s.submodule_search_locations else '')"
    OUTPUT_VARIABLE _cutlass_pkg
    ERROR_QUIET
    OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(_cutlass_pkg)
    _epifuse_cutlass_root_of("${_cutlass_pkg}" _cutlass_root)
    set(_cutlass_tried "python package cutlass_library at ${_cutlass_pkg} (no source/include/cutlass/cutlass.h)")
  else()
    set(_cutlass_tried "no cutlass_library module for ${EPIFUSE_PYTHON}")
  endif()
  if(_cutlass_root)
    set(_cutlass_how "pip package nvidia-cutlass (${EPIFUSE_PYTHON})")
  endif()
endif()

if(NOT _cutlass_root)
  message(FATAL_ERROR
    "epifuse: CUTLASS ${EPIFUSE_CUTLASS_VERSION} headers not found (${_cutlass_tried}).\n"
    "Provide them in one of two ways:\n"
    "  a) pip install ${EPIFUSE_CUTLASS_PIP_SPEC}   (into the Python used for the build: "
    "${EPIFUSE_PYTHON}; offline: add --no-index --find-links <dir with the wheel>), or\n"
    "  b) cmake ... -DCUTLASS_DIR=<CUTLASS ${EPIFUSE_CUTLASS_VERSION} checkout, or the wheel's cutlass_library/source>\n"
    "(scripts/build.sh does (a) automatically.)")
endif()

# Version check against the pin.
file(STRINGS "${_cutlass_root}/include/cutlass/version.h" _cutlass_ver_lines
     REGEX "^#define CUTLASS_(MAJOR|MINOR|PATCH) ")
set(_cv_MAJOR "?")
set(_cv_MINOR "?")
set(_cv_PATCH "?")
foreach(_l IN LISTS _cutlass_ver_lines)
  if(_l MATCHES "^#define CUTLASS_(MAJOR|MINOR|PATCH) +([0-9]+)")
    set(_cv_${CMAKE_MATCH_1} "${CMAKE_MATCH_2}")
  endif()
endforeach()
set(CUTLASS_VERSION "${_cv_MAJOR}.${_cv_MINOR}.${_cv_PATCH}")
if(NOT CUTLASS_VERSION VERSION_EQUAL EPIFUSE_CUTLASS_VERSION)
  if(EPIFUSE_ALLOW_CUTLASS_VERSION_MISMATCH)
    message(WARNING "epifuse: using CUTLASS ${CUTLASS_VERSION} from ${_cutlass_root}; "
                    "epifuse is pinned to ${EPIFUSE_CUTLASS_VERSION} (mismatch allowed).")
  else()
    message(FATAL_ERROR
      "epifuse: CUTLASS at ${_cutlass_root} is version ${CUTLASS_VERSION}, but epifuse "
      "is pinned to ${EPIFUSE_CUTLASS_VERSION}.\n"
      "Use `pip install ${EPIFUSE_CUTLASS_PIP_SPEC}` or -DCUTLASS_DIR=<CUTLASS "
      "${EPIFUSE_CUTLASS_VERSION}>, or pass -DEPIFUSE_ALLOW_CUTLASS_VERSION_MISMATCH=ON "
      "to try it anyway.")
  endif()
endif()

set(CUTLASS_ROOT "${_cutlass_root}")
set(CUTLASS_INCLUDE_DIRS "${_cutlass_root}/include")
if(EXISTS "${_cutlass_root}/tools/util/include")
  list(APPEND CUTLASS_INCLUDE_DIRS "${_cutlass_root}/tools/util/include")
endif()

if(NOT TARGET epifuse::cutlass)
  add_library(epifuse_cutlass INTERFACE)
  add_library(epifuse::cutlass ALIAS epifuse_cutlass)
  # SYSTEM: keep CUTLASS's own warnings out of our build log.
  target_include_directories(epifuse_cutlass SYSTEM INTERFACE ${CUTLASS_INCLUDE_DIRS})
endif()

message(STATUS "epifuse: CUTLASS ${CUTLASS_VERSION} from ${_cutlass_how}: ${CUTLASS_ROOT}")
