# oasiskv_enable_warnings()
#
# Adds OasisKV's warning flags to every target created afterwards in the calling directory and its
# subdirectories (library, tests, examples, benchmarks, header check). Directory-scoped compile
# options are never part of a target's usage requirements, so nothing leaks into consumers, and a
# super-project that add_subdirectory()s OasisKV keeps its own flags.
#
# OASISKV_WERROR (default ON when top level) turns warnings into errors for C++. For CUDA sources
# the host compiler gets -Wall -Wextra; -Werror for CUDA is left to the CUDA backend to decide.
function(oasiskv_enable_warnings)
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    add_compile_options(
      "$<$<COMPILE_LANGUAGE:CXX>:-Wall;-Wextra;-Wpedantic>"
      "$<$<AND:$<COMPILE_LANGUAGE:CXX>,$<BOOL:${OASISKV_WERROR}>>:-Werror>"
      "$<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>")
    # GCC 12's optimiser reports false positives inside libstdc++ (std::string and memcpy at -O2/-O3,
    # e.g. GCC bugs 105329, 105651): keep them as warnings, never as errors.
    if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND CMAKE_CXX_COMPILER_VERSION VERSION_LESS 14)
      add_compile_options(
        "$<$<COMPILE_LANGUAGE:CXX>:-Wno-error=restrict;-Wno-error=array-bounds;-Wno-error=stringop-overflow;-Wno-error=stringop-overread>")
    endif()
  elseif(MSVC)
    add_compile_options(
      "$<$<COMPILE_LANGUAGE:CXX>:/W4>"
      "$<$<AND:$<COMPILE_LANGUAGE:CXX>,$<BOOL:${OASISKV_WERROR}>>:/WX>")
  endif()
endfunction()
