# ctest's fuzz_<name>: SECONDS of libFuzzer, starting from the seeds each time. libFuzzer reads
# every folder given and writes new inputs only into the first (WORK), so SEEDS (the
# repository's corpus) is never written; a failing input goes to WORK-artifacts/.
# Inputs: FUZZER, WORK, SEEDS, SECONDS, DICT (used when the file exists).
file(REMOVE_RECURSE ${WORK})
set(dict "")
if(EXISTS ${DICT})
  set(dict -dict=${DICT})
endif()
file(MAKE_DIRECTORY ${WORK} ${WORK}-artifacts)
execute_process(COMMAND ${FUZZER} ${WORK} ${SEEDS} -max_total_time=${SECONDS} -timeout=20
                        -print_final_stats=1 -artifact_prefix=${WORK}-artifacts/ ${dict}
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  file(GLOB found ${WORK}-artifacts/*)
  message(FATAL_ERROR "${FUZZER} found a failing input (exit ${rc}): ${found}\n"
                      "Reproduce: ${FUZZER} <input>; fix, then keep the input in fuzz/regressions/.")
endif()
