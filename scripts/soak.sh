#!/usr/bin/env bash
# Crash soak: a run killed with SIGKILL at random moments and resumed each time ends with
# bitwise the parameters of an uninterrupted run, and no checkpoint it leaves is ever unreadable.
#
#   scripts/soak.sh FRUGAL [KILLS] [SEED]      (defaults: 20 kills, seed 1)
#
# FRUGAL is the `frugal` binary (this script builds nothing). It trains a small synthetic MLP
# (two stages, dropout, Adam; a checkpoint every 3 steps, 3 kept; validation every 8 batches)
# once uninterrupted, then again with `--resume auto` (the requeue command), SIGKILLing each
# life but the last. The kills aim in turn at a batch (the moment one is logged while no write
# is under way), a checkpoint write (the moment its temporary file appears, polled every
# millisecond) and a validation (the moment an epoch's last batch is logged), each after a
# random delay of up to 0.15 s: random timing alone seldom lands inside a write, which lasts
# a few milliseconds, and a third of the time is spent writing checkpoints here.
# After each kill it reports the phase the run was in (read from the run folder and the log),
# checks every checkpoint left with `frugal check --checkpoint`, and at the end compares the
# two runs' model.safetensors byte for byte.
# Exit status 0 only if every check passed. SOAK_DIR=... keeps the work folder there.
set -uo pipefail

frugal=${1:?usage: soak.sh FRUGAL [KILLS] [SEED]}
kills=${2:-20}
seed=${3:-1}
[[ $frugal == */* ]] || frugal=$(command -v "$frugal")
frugal=$(cd "$(dirname "$frugal")" && pwd)/$(basename "$frugal")
[ -x "$frugal" ] || { echo "soak: '$frugal' is not an executable" >&2; exit 2; }
RANDOM=$seed

pid=""
if [ -n "${SOAK_DIR:-}" ]; then
  work=$SOAK_DIR
  rm -rf "$work" && mkdir -p "$work"
else
  work=$(mktemp -d "${TMPDIR:-/tmp}/frugal-soak.XXXXXX")
fi
# A soak stopped from outside (ctest's timeout, Ctrl-C) leaves no training behind.
cleanup() {
  [ -n "$pid" ] && kill -KILL "$pid" 2>/dev/null
  [ -n "${SOAK_DIR:-}" ] || rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
started=$(date +%s)
failures=0
fail() { echo "soak: FAIL: $*"; failures=$((failures + 1)); }

# 8 batches an epoch; an epoch's validation (2048 samples) takes about as long as its training.
# Long enough that every life but the last is killed before the run ends.
epochs=$(( kills / 2 + 3 ))
batches=8
cat > "$work/soak.toml" <<EOF
[run]
progress = "log"
log_every = 1
threads = 1
seed = 11
checkpoint_every = 3
keep_checkpoints = 3
[data]
dataset = "synthetic"
samples = 8192
train_samples = $(( batches * 32 ))
image_size = 16
classes = 10
batch_size = 32
valid_batch_size = 256
[model]
arch = "mlp"
width = 512
depth = 3
dropout = 0.1
[optimizer]
name = "adam"
lr = 0.001
[[stages]]
name = "first"
epochs = $(( epochs / 2 ))
freeze = ["stem"]
[[stages]]
name = "second"
epochs = $(( epochs - epochs / 2 ))
EOF

# Polling without a fork: the clock from $EPOCHREALTIME, naps as reads that time out on a pipe
# nobody writes to. A checkpoint's temporary file lives a few milliseconds.
exec {never}<> <(:)
ms() { local t=${EPOCHREALTIME/[.,]/}; echo $(( t / 1000 )); }
now_ms() { local t=${EPOCHREALTIME/[.,]/}; now=$(( t / 1000 )); }  # sets $now
nap() {  # $1 milliseconds
  local s
  printf -v s '%d.%03d' $(( $1 / 1000 )) $(( $1 % 1000 ))
  read -r -t "$s" -u "$never"
}
alive() { kill -0 "$1" 2>/dev/null; }

# Waits (at most $1 s) for process $pid to end; its exit status (137: killed at the limit).
wait_for_end() {
  local deadline=$(( $(ms) + $1 * 1000 ))
  while alive "$pid" && [ "$(ms)" -lt "$deadline" ]; do nap 20; done
  alive "$pid" && { echo "soak: $pid still runs after $1 s: killed"; kill -KILL "$pid"; }
  wait "$pid"
  local rc=$?
  pid=""  # reaped: its number may be reused
  return $rc
}

# Runs `frugal ARGS...` to its end (at most $1 s), its output in $2.
finish() {
  local limit=$1 log=$2; shift 2
  "$frugal" "$@" > "$log" 2>&1 &
  pid=$!
  wait_for_end "$limit"
}

# Waits (at most $3 s) until the command $2 succeeds while process $1 lives; 1 if it ended.
wait_until() {
  local pid=$1 test=$2 now deadline=$(( $(ms) + $3 * 1000 ))
  while alive "$pid"; do
    eval "$test" && return 0
    now_ms
    [ "$now" -gt "$deadline" ] && return 0
    nap 1
  done
  return 1
}

run=$work/run
ckdir=$run/checkpoints
# The temporary files of process $1 (a write it had begun), or of any process without $1.
temp_files() { compgen -G "$ckdir/*.tmp.${1:-*}"; compgen -G "$run/*.tmp.${1:-*}"; }
last_line() { tail -n 1 "$1" 2>/dev/null; }
# The life's log followed without a fork: $last is its newest complete line.
follow() {
  local line
  while IFS= read -r -u "$logfd" line; do last=$line; done
}
at_validation() { follow; [[ $last == *" batch $batches/$batches "* ]]; }
# Between batches of an epoch, no checkpoint being written: the next batch is starting.
at_batch() {
  follow
  [[ $last == *" batch "[1-7]"/$batches "* ]] && ! compgen -G "$ckdir/*.tmp.$pid" > /dev/null
}

# The phase a killed life was in: a checkpoint's temporary file -> its write; a model file's
# -> the final export; an epoch's last batch logged and nothing after -> its validation.
phase_of() {
  local log=$1 pid=$2 line
  if compgen -G "$ckdir/*.tmp.$pid" > /dev/null; then echo checkpoint-write; return; fi
  if compgen -G "$run/*.tmp.$pid" > /dev/null; then echo model-write; return; fi
  line=$(last_line "$log")
  case "$line" in
    *" batch $batches/$batches "*) echo validation ;;
    *" batch "*|*"training "*|*"stage "*|*"] epoch "*) echo batch ;;
    *) echo start-up ;;
  esac
}

# Every checkpoint in the run folder must load: the link and each numbered file. Sets $checks.
check_checkpoints() {
  local files=() f out
  checks="none yet"
  for f in "$ckdir"/last.ckpt "$ckdir"/step-*.ckpt; do [ -e "$f" ] && files+=(--checkpoint "$f"); done
  # (No last.ckpt beside numbered files is a kill before the first link: resume takes the newest.)
  if [ -L "$ckdir/last.ckpt" ] && [ ! -e "$ckdir/last.ckpt" ]; then
    fail "last.ckpt names a file that is not there: $(ls -l "$ckdir")"
  fi
  [ ${#files[@]} -eq 0 ] && return
  checked=$(( checked + ${#files[@]} / 2 ))
  if out=$(timeout 120 "$frugal" --log-level warn check "$work/soak.toml" --set run.out_dir="$run" \
      "${files[@]}" 2>&1); then
    checks="$(( ${#files[@]} / 2 )) readable"
  else
    checks="UNREADABLE"
    fail "a checkpoint left by the kill does not load: $out"
  fi
}

echo "soak: $kills kills, seed $seed, $(( epochs * batches )) steps, work folder $work"
t0=$(ms)
if ! finish 300 "$work/ref.log" train "$work/soak.toml" --set run.out_dir="$work/ref" \
    --set run.progress=none; then
  echo "soak: the uninterrupted run failed:"; tail -n 20 "$work/ref.log"; exit 1
fi
echo "soak: uninterrupted run: $(( $(ms) - t0 )) ms"

declare -A hit=()
checked=0 resumes=0 killed=0 life=0
targets=(batch checkpoint-write validation)
while :; do
  life=$((life + 1))
  log=$work/life-$life.log
  : > "$log"
  [ -n "${logfd:-}" ] && exec {logfd}<&-
  exec {logfd}< "$log"
  last=""
  "$frugal" train "$work/soak.toml" --set run.out_dir="$run" --resume auto > "$log" 2>&1 &
  pid=$!
  if [ "$killed" -ge "$kills" ]; then  # the last life runs to its end
    wait_for_end 300; rc=$?
    grep -q "resuming from" "$log" && resumes=$((resumes + 1))
    [ "$rc" -eq 0 ] || { fail "the last life exited with $rc:"; tail -n 20 "$log"; }
    break
  fi
  target=${targets[$(( killed % 3 ))]}
  # Training has started (the data is loaded; a resume has read its checkpoint).
  if wait_until "$pid" "grep -q '] training ' '$log'" 120; then
    nap $(( RANDOM % 150 ))
    case $target in
      batch) wait_until "$pid" at_batch 2 ;;
      checkpoint-write) wait_until "$pid" "compgen -G '$ckdir/*.tmp.$pid' > /dev/null" 2 ;;
      validation) wait_until "$pid" at_validation 2 ;;
    esac
  fi
  if ! alive "$pid"; then
    wait_for_end 0; rc=$?
    grep -q "resuming from" "$log" && resumes=$((resumes + 1))
    if [ "$rc" -eq 0 ]; then
      fail "life $life ended (exit 0) before kill $((killed + 1)) of $kills: a longer run is needed"
    else
      fail "life $life exited with $rc before its kill:"; tail -n 20 "$log"
    fi
    break
  fi
  kill -KILL "$pid"
  wait "$pid" 2>/dev/null
  killed=$((killed + 1))
  grep -q "resuming from" "$log" && resumes=$((resumes + 1))
  phase=$(phase_of "$log" "$pid")
  pid=""
  hit[$phase]=$(( ${hit[$phase]:-0} + 1 ))
  at=$(grep -o "\[[a-z]*\] epoch [0-9/]*\( batch [0-9/]*\)\?" "$log" | tail -n 1)
  check_checkpoints
  printf 'soak: kill %2d, aimed at %-16s -> %-16s at %-30s checkpoints: %s\n' \
    "$killed" "$target" "$phase" "${at:-start-up}" "$checks"
done

# The resumed run's parameters against the uninterrupted run's, bit for bit: model.safetensors
# holds them after a header of names, shapes and offsets (the same for both runs), so equal
# bytes are equal tensors. When they differ, /usr/bin/python3 (if present) names the tensors.
equal=no
if [ ! -f "$run/model.safetensors" ]; then
  fail "the killed run left no model.safetensors"
elif cmp -s "$work/ref/model.safetensors" "$run/model.safetensors"; then
  equal=yes
  echo "soak: final parameters bitwise equal ($(stat -c %s "$run/model.safetensors") bytes of" \
       "model.safetensors; model.pt $(cmp -s "$work/ref/model.pt" "$run/model.pt" && echo identical || echo differs))"
else
  which=$([ -x /usr/bin/python3 ] && /usr/bin/python3 - "$work/ref/model.safetensors" \
    "$run/model.safetensors" <<'EOF'
import json, struct, sys
def tensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    header.pop("__metadata__", None)
    return {k: data[v["data_offsets"][0]:v["data_offsets"][1]] for k, v in header.items()}
a, b = tensors(sys.argv[1]), tensors(sys.argv[2])
print("tensors that differ:", ", ".join(sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))))
EOF
)
  fail "final parameters differ from the uninterrupted run's${which:+: $which}"
fi
leftover=$(temp_files | wc -l)
[ "$leftover" -eq 0 ] || fail "temporary files left in the run folder: $(temp_files | tr '\n' ' ')"

phases=""
for p in batch checkpoint-write validation model-write start-up; do
  [ -n "${hit[$p]:-}" ] && phases+="${phases:+, }$p ${hit[$p]}"
done
echo "soak: kills $killed/$kills; phases hit: ${phases:-none}; resumes $resumes; checkpoints checked" \
     "$checked; bitwise equal: $equal; $(( $(date +%s) - started )) s"
[ "$failures" -eq 0 ] && [ "$killed" -eq "$kills" ] || { echo "soak: FAILED ($failures failure(s))"; exit 1; }
echo "soak: OK"
