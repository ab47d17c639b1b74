// The conformance suite: one source, compiled for every backend (tests/test_conformance.cpp for
// the CPU, tests/cuda/test_conformance.cpp for CUDA, where it runs only with a GPU). Each case is
// a function template over a harness (harness.hpp) and the rig of rig.hpp, in a file named after
// what it tests (lifecycle.hpp, selection.hpp, tickets.hpp, truncate_and_fork.hpp,
// random_integrity.hpp, random_sequence_ops.hpp); OASISKV_CONFORMANCE_CASES registers them all.
// Inputs are fresh seeded random rows (the seed is printed on failure; OASISKV_TEST_SEED reruns).
#pragma once

#include "lifecycle.hpp"
#include "random_integrity.hpp"
#include "random_sequence_ops.hpp"
#include "selection.hpp"
#include "tickets.hpp"
#include "truncate_and_fork.hpp"

// Registers every conformance case for harness H with TEST_MACRO (TEST_CASE, or a macro that
// counts cases), names prefixed by PREFIX (a string literal). No commas or semicolons in the names:
// ctest discovery drops the labels of the one and splits the other.
#define OASISKV_CONFORMANCE_CASES(H, TEST_MACRO, PREFIX)                                                          \
  TEST_MACRO(PREFIX "conformance: sequence lifecycle") { ::oasiskv::test::conformance::lifecycle<H>(); }          \
  TEST_MACRO(PREFIX "conformance: a budget covering the context gives dense attention (float)") {                \
    ::oasiskv::test::conformance::dense_equivalence<H, float>();                                                  \
  }                                                                                                               \
  TEST_MACRO(PREFIX "conformance: a budget covering the context gives dense attention (fp16)") {                 \
    ::oasiskv::test::conformance::dense_equivalence<H, ::oasiskv::fp16_t>();                                      \
  }                                                                                                               \
  TEST_MACRO(PREFIX "conformance: a budget covering the context gives dense attention (bf16)") {                 \
    ::oasiskv::test::conformance::dense_equivalence<H, ::oasiskv::bf16_t>();                                      \
  }                                                                                                               \
  TEST_MACRO(PREFIX "conformance: the working set is the pinned blocks plus the brute-force top-K") {            \
    ::oasiskv::test::conformance::working_set<H>();                                                               \
  }                                                                                                               \
  TEST_MACRO(PREFIX "conformance: the fetch cap and the statistics") {                                           \
    ::oasiskv::test::conformance::fetch_cap_and_statistics<H>();                                                  \
  }                                                                                                               \
  TEST_MACRO(PREFIX "conformance: ticket rules - supersede release stale and another cache") {                    \
    ::oasiskv::test::conformance::ticket_rules<H>();                                                              \
  }                                                                                                               \
  TEST_MACRO(PREFIX "conformance: recover_layer drops the layer's tickets and refills it") {                     \
    ::oasiskv::test::conformance::recover_layer<H>();                                                             \
  }                                                                                                               \
  TEST_MACRO(PREFIX "conformance: truncate keeps exactly the rows below the length as if never appended") {    \
    ::oasiskv::test::conformance::truncate_rows<H>();                                                             \
  }                                                                                                               \
  TEST_MACRO(PREFIX "conformance: bad calls are refused with the value named and change nothing") {              \
    ::oasiskv::test::conformance::bad_calls<H>();                                                                 \
  }                                                                                                               \
  TEST_MACRO(PREFIX "conformance: random use keeps every view and the host tier equal to the rows appended") {   \
    ::oasiskv::test::conformance::random_integrity<H>();                                                          \
  }                                                                                                               \
  TEST_MACRO(PREFIX "conformance: fork shares full blocks and copies the partial block on first write") {     \
    ::oasiskv::test::conformance::fork_shares_blocks<H>();                                                        \
  }                                                                                                               \
  TEST_MACRO(PREFIX "conformance: random sequence operations with forks match a reference model bit for bit") {   \
    ::oasiskv::test::conformance::random_sequence_ops<H>();                                                       \
  }                                                                                                               \
  TEST_MACRO(PREFIX "conformance: a plan past the recent ring never serves a block still being filled") {        \
    ::oasiskv::test::conformance::plan_past_the_ring<H>();                                                        \
  }                                                                                                               \
  TEST_MACRO(PREFIX "conformance: a sequence and its fork appended in one batch take one copy of their block") { \
    ::oasiskv::test::conformance::fork_batch_append<H>();                                                         \
  }
