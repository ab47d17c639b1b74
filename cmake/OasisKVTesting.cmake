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
