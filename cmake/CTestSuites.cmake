# Run by ctest (a TEST_INCLUDE_FILES script, see tests/CMakeLists.txt): one test per gtest test
# suite of FRUGAL_TEST_BINARY, `--gtest_filter=Suite.*`, listed from the binary at ctest time.
# A LibTorch process needs about a second to start (twice that under ASan): 119 suites start
# 119 processes where 411 tests would start 411. Suites named in FRUGAL_ISOLATED_SUITES keep one
# process per test (their tests need a fresh process).
#
# Labels: a suite in FRUGAL_CLI_SUITES starts the `frugal` CLI (label `cli`), any other is
# `unit`; each test sees its label in FRUGAL_TEST_LABEL (tests/cli_support.h fails a unit test
# that starts the CLI, so the list stays true).
#
# Inputs: FRUGAL_TEST_BINARY, FRUGAL_TEST_TIMEOUT, FRUGAL_ISOLATED_SUITES, FRUGAL_CLI_SUITES
# (;-lists).
if(NOT EXISTS "${FRUGAL_TEST_BINARY}")
  add_test(frugal_tests_NOT_BUILT "${FRUGAL_TEST_BINARY}")
  return()
endif()
execute_process(COMMAND "${FRUGAL_TEST_BINARY}" --gtest_list_tests
                OUTPUT_VARIABLE listing RESULT_VARIABLE rc TIMEOUT 120)
if(NOT rc EQUAL 0)
  add_test(frugal_tests_LIST_FAILED "${FRUGAL_TEST_BINARY}" --gtest_list_tests)
  return()
endif()
string(REPLACE "\n" ";" lines "${listing}")
set(suite "")
function(frugal_suite_test name suite)
  list(FIND FRUGAL_CLI_SUITES "${suite}" cli)
  if(cli EQUAL -1)
    set(label unit)
  else()
    set(label cli)
  endif()
  set_tests_properties("${name}" PROPERTIES TIMEOUT ${FRUGAL_TEST_TIMEOUT} LABELS ${label}
                       ENVIRONMENT "FRUGAL_TEST_LABEL=${label}")
endfunction()
foreach(line IN LISTS lines)
  if(line MATCHES "^([A-Za-z0-9_/]+)\\.")
    set(suite "${CMAKE_MATCH_1}")
    list(FIND FRUGAL_ISOLATED_SUITES "${suite}" isolated)  # (no IN_LIST: ctest's policies are old)
    if(isolated EQUAL -1)
      add_test("${suite}" "${FRUGAL_TEST_BINARY}" "--gtest_filter=${suite}.*")
      frugal_suite_test("${suite}" "${suite}")
    endif()
  elseif(line MATCHES "^  ([A-Za-z0-9_/]+)" AND NOT isolated EQUAL -1)
    set(name "${suite}.${CMAKE_MATCH_1}")
    add_test("${name}" "${FRUGAL_TEST_BINARY}" "--gtest_filter=${name}")
    frugal_suite_test("${name}" "${suite}")
  endif()
endforeach()
