#!/usr/bin/env bash
# Tests scripts/check-file-lengths on a fixture (a temporary directory, not a checkout): a source
# file of 651 lines and an extensionless script of 700 are named and fail the check; a file of
# exactly 650 lines, a long Markdown file and the generated table (unicode_tables.inc) pass.
# Usage: check_file_lengths_catches.sh <path of scripts/check-file-lengths>
set -euo pipefail
checker="$1"
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
lines() { mkdir -p "$(dirname "$dir/$2")"; { [[ "$2" == scripts/* ]] && echo '#!/bin/sh'; seq 1 "$1"; } | head -n "$1" >"$dir/$2"; }
lines 650 src/exact.cpp
lines 651 src/long.cpp
lines 700 scripts/long-script
lines 2000 docs/long.md
lines 2000 examples/smollm2/engine/unicode_tables.inc
set +e
out="$("$checker" "$dir" 2>&1)"
rc=$?
set -e
echo "$out"
fail() { echo "check_file_lengths_catches: $1" >&2; exit 1; }
[[ $rc -eq 1 ]] || fail "expected exit 1, got $rc"
grep -q "src/long.cpp has 651 lines" <<<"$out" || fail "src/long.cpp (651 lines) not named"
grep -q "scripts/long-script has 700 lines" <<<"$out" || fail "scripts/long-script (700 lines) not named"
! grep -q -e exact.cpp -e long.md -e unicode_tables <<<"$out" || fail "a file within the rule was named"
rm "$dir/src/long.cpp" "$dir/scripts/long-script"
"$checker" "$dir" || fail "the fixture within the rule failed"
echo "check_file_lengths_catches: OK"
