#!/usr/bin/env bash
# A/B of two commands on this machine, in ABBA order: each command prints one number on
# its last line of output (a metric: tok/s, ms, % of a bound), and the pairs alternate
# which runs first, since on a shared machine the second process of a pair can run a few
# percent faster by its place alone (docs/correctness-and-performance.md, "On the order
# of a pair"). Prints every run, then each command's median and the ratio B/A.
#
#   scripts/ab.sh BLOCKS 'command A' 'command B'
#
# e.g. the decode step's share of its bound, one build against another:
#   scripts/ab.sh 3 "old/decode_step 2 3 576 32 | sed -n 's/.*at \([0-9]*\) %.*/\1/p' | tail -1" \
#                   "new/decode_step 2 3 576 32 | sed -n 's/.*at \([0-9]*\) %.*/\1/p' | tail -1"
set -euo pipefail

if [[ $# -ne 3 || ! $1 =~ ^[1-9][0-9]*$ ]]; then
  sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//' >&2
  echo "ab.sh: expected BLOCKS (a positive integer) and two commands" >&2
  exit 2
fi
blocks=$1
cmds=("$2" "$3")
names=(A B)
vals=("" "")

run() {
  local i=$1 out last
  if ! out=$(bash -c "${cmds[$i]}"); then
    echo "ab.sh: command ${names[$i]} failed: ${cmds[$i]}" >&2
    exit 1
  fi
  last=$(printf '%s\n' "$out" | tail -n 1 | tr -d '[:space:]')
  if [[ ! $last =~ ^-?[0-9]+([.][0-9]+)?$ ]]; then
    echo "ab.sh: command ${names[$i]} printed '$last' last, not a number" >&2
    exit 1
  fi
  echo "${names[$i]} $last"
  vals[$i]+="$last "
}

for ((b = 0; b < blocks; b++)); do
  # A B, then B A: each command runs first in half of the pairs.
  run 0; run 1; run 1; run 0
done

median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{v[NR]=$1} END {print (NR % 2) ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2}'; }
ma=$(printf '%s' "${vals[0]}" | median)
mb=$(printf '%s' "${vals[1]}" | median)
echo "median A $ma, B $mb ($((2 * blocks)) runs each); B/A $(awk -v a="$ma" -v b="$mb" 'BEGIN {printf (a == 0) ? "undefined" : "%.4f", b / a}')"
