# oasiskv_discover_tests(<target> [<extra doctest_discover_tests arguments>...])
#
# Registers every doctest TEST_CASE of <target> as its own ctest test, labelled with its doctest
# test suite(s): a case inside TEST_SUITE("pipeline") (or decorated `* doctest::test_suite("pipeline")`)
# gets the ctest label `pipeline` and runs with `ctest -L pipeline` (the TSan run); TEST_SUITE("model")
# gets `model`, which the sanitizer runs exclude with `ctest -LE model`.
# Test case names must not contain semicolons (CMake's list separator splits the name into two
# tests that match nothing); a name with a comma keeps its test but loses its labels (so it would
# escape the TSan run): avoid both. A registered test that runs no test case fails.
include_guard(GLOBAL)

if(NOT COMMAND doctest_discover_tests)
  find_package(doctest 2.4 CONFIG REQUIRED)
  include("${doctest_DIR}/doctest.cmake")
endif()

function(oasiskv_discover_tests target)
  doctest_discover_tests(${target}
    ADD_LABELS 1
    PROPERTIES TIMEOUT 600 FAIL_REGULAR_EXPRESSION "test cases: +0 [|]"
    ${ARGN})
endfunction()

# oasiskv_discover_isa_tests(<target> [<extra doctest_discover_tests arguments>...])
#
# Registers every doctest TEST_CASE of <target> once per CPU instruction-set level
# (oasiskv/cpu/isa.hpp), as "<case> [<level>]", run with OASISKV_CPU_ISA=<level>: so one machine
# tests every path its CPU can run, whatever the highest is. <target>'s main is tests/isa_main.cpp,
# which reports a level the CPU lacks as skipped (exit 77). For the kernels and the tests that
# compare a fast path with its reference; everything else runs once, at the CPU's own level.
# LEVELS <level>...: only those (default: every level this architecture has).
function(oasiskv_discover_isa_tests target)
  cmake_parse_arguments(PARSE_ARGV 1 isa "" "" "LEVELS")
  set(levels scalar)
  if(CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64|i.86)$")
    list(APPEND levels avx2 avx512)
  endif()
  if(isa_LEVELS)
    set(levels ${isa_LEVELS})
  endif()
  foreach(level IN LISTS levels)
    # --oasiskv-isa: the level again on the command line (doctest ignores it; isa_main.cpp checks
    # that it matches the environment), which also keeps each level's discovery file apart.
    doctest_discover_tests(${target}
      TEST_SUFFIX " [${level}]"
      EXTRA_ARGS "--oasiskv-isa=${level}"
      TEST_LIST ${target}_${level}_TESTS
      ADD_LABELS 1
      PROPERTIES TIMEOUT 600 SKIP_RETURN_CODE 77 ENVIRONMENT "OASISKV_CPU_ISA=${level}"
                 FAIL_REGULAR_EXPRESSION "test cases: +0 [|]"
      ${isa_UNPARSED_ARGUMENTS})
  endforeach()
endfunction()
