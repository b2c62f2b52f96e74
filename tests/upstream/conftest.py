"""tests/upstream holds pytest plugins and tools for running *Lightning's and Accelerate's* test
suites with stagesave (scripts/upstream-tests.sh), not tests of stagesave: never collect them."""

collect_ignore_glob = ["*.py"]
