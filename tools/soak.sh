#!/bin/sh
# Soak test (not part of `make test`): clone the committed HEAD into a fresh folder, then run the README's test
# command N times in a row (default 5) while a CPU hog keeps one core busy beside it, and print the pass count.
# A flaky test shows up here long before it shows up in CI.
#
#     sh tools/soak.sh          # 5 runs
#     sh tools/soak.sh 10       # 10 runs; logs stay in the printed folder if a run fails
set -u
runs=${1:-5}
src=$(git rev-parse --show-toplevel) || exit 2
work=$(mktemp -d "${TMPDIR:-/tmp}/course-soak.XXXXXX")
git clone -q "$src" "$work/course" || exit 2
cd "$work/course" || exit 2
setsid yes > /dev/null &                           # the hog: one core kept busy for the whole soak
hog=$!
failed=0
run=
cleanup() {
    [ -n "$run" ] && kill -- "-$run" 2>/dev/null   # make, pytest, its workers and kernels
    kill -- "-$hog" 2>/dev/null
    if [ "$failed" -eq 0 ]; then rm -rf "$work"; else echo "logs of the failed runs: $work/course/soak-*.log"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM                           # exit runs cleanup
passed=0
i=1
while [ "$i" -le "$runs" ]; do
    start=$(date +%s)
    setsid make test > "soak-$i.log" 2>&1 &        # its own process group: an interrupted soak ends it whole
    run=$!
    if wait "$run"; then
        run=; passed=$((passed + 1)); verdict=passed
    else
        run=; failed=$((failed + 1)); verdict="FAILED ($(grep -E '^_{3,} .+ _{3,}$' "soak-$i.log" | sed -E 's/^_+ (.+) _+$/\1/' | head -3 | tr '\n' ' '))"
    fi
    echo "run $i of $runs: $verdict in $(( $(date +%s) - start )) s ($(tail -n 1 "soak-$i.log" | tr -d '=' | sed 's/^ *//'))"
    i=$((i + 1))
done
echo "soak: $passed of $runs runs of make test passed on a fresh clone with a CPU hog beside them"
[ "$passed" -eq "$runs" ]
