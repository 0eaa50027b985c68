#!/usr/bin/env bash
# `make test-slurm`: a real SLURM cluster on this one host runs examples/slurm_job.sbatch.
#
# Installs munge and SLURM with apt if missing (so it needs root), then starts, in a temporary
# directory and on 127.0.0.1 only: munged with its own key, slurmctld, and two slurmd daemons
# registered as two nodes (SLURM's multiple-slurmd setup: one host, one port per node; no
# cgroups). Node 0 is named after this host, so its name resolves the way a real node's does
# (the coordinator's address is node 0's name); node 1 is that name + "-1".
# tests/slurm/jobs.py then submits the jobs and checks them. Every daemon started here is
# stopped by its pid when this script exits, whether the checks passed or not, and any process
# of the test still running after that is killed.
#
# JAXCOLL_PYTHON / JAXCOLL_RUN: the python and jaxcoll-run the jobs use (default: the repo's
# .venv, which `make test-slurm` creates). KEEP=1 keeps the temporary directory (logs).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
export JAXCOLL_PYTHON=${JAXCOLL_PYTHON:-$ROOT/.venv/bin/python}
export JAXCOLL_RUN=${JAXCOLL_RUN:-$ROOT/.venv/bin/jaxcoll-run}
T0=$SECONDS

say() { echo "test-slurm: $*"; }
fail() { echo "test-slurm: error: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || fail "needs root (apt-get, and munged/slurmd run as root)"
[ -x "$JAXCOLL_PYTHON" ] && [ -x "$JAXCOLL_RUN" ] ||
  fail "no $JAXCOLL_PYTHON or $JAXCOLL_RUN: run 'make test-slurm', which installs them"

# --- packages: install what is missing, without letting apt start the system's own daemons
missing=()
for pair in munged:munge slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client; do
  command -v "${pair%%:*}" >/dev/null || missing+=("${pair#*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
  say "installing ${missing[*]} (apt-get)"
  policy=""
  if [ ! -e /usr/sbin/policy-rc.d ]; then  # Debian's switch: packages do not start services
    policy=/usr/sbin/policy-rc.d
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy"
  fi
  rc=0
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      --no-install-recommends "${missing[@]}" >/dev/null; } || rc=$?
  [ -z "$policy" ] || rm -f "$policy"
  [ $rc = 0 ] || fail "apt-get install ${missing[*]} failed (exit $rc)"
fi

# --- the cluster's files, in one temporary directory
TMP=$(mktemp -d /tmp/jaxcoll-slurm.XXXXXX)
chmod 755 "$TMP"                      # munged wants its socket's directories searchable by all
export TEST_SLURM_RUN=$TMP            # marks every process of this test (for the last sweep)
PIDS=()
NAMES=()

cleanup() {
  local rc=$? i pid left
  set +e
  trap - INT TERM
  if [ -n "${JOBS_PID:-}" ] && kill -0 "$JOBS_PID" 2>/dev/null; then
    kill -TERM "$JOBS_PID" 2>/dev/null
    wait "$JOBS_PID" 2>/dev/null
  fi
  if [ -n "${SLURM_CONF:-}" ] && [ ${#PIDS[@]} -gt 1 ]; then
    scancel --quiet --user=root >/dev/null 2>&1        # jobs still running after a failure
    for _ in $(seq 50); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.2; done
  fi
  for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do        # slurmd, slurmctld, then munged
    kill -TERM "${PIDS[i]}" 2>/dev/null
  done
  for _ in $(seq 50); do
    left=0
    for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && left=1; done
    [ $left = 0 ] && break
    sleep 0.2
  done
  for ((i = 0; i < ${#PIDS[@]}; i++)); do
    if kill -0 "${PIDS[i]}" 2>/dev/null; then
      echo "test-slurm: ${NAMES[i]} ignored SIGTERM; SIGKILL" >&2
      kill -KILL "${PIDS[i]}" 2>/dev/null
    fi
  done
  wait 2>/dev/null
  # Anything else of this test (slurmstepd, a task) still alive: kill it, by pid.
  left=$(env -u TEST_SLURM_RUN "$JAXCOLL_PYTHON" - "$TMP" "$$" <<'EOF'
import glob, os, signal, sys
needle = f"TEST_SLURM_RUN={sys.argv[1]}".encode()
spare = {int(sys.argv[2]), os.getpid(), os.getppid()}  # run.sh, this sweep and its subshell
for path in glob.glob("/proc/[0-9]*/environ"):
    pid = int(path.split("/")[2])
    try:
        with open(path, "rb") as fh:
            if pid in spare or needle not in fh.read().split(b"\0"):
                continue
        os.kill(pid, signal.SIGKILL)
        print(pid, end=" ")
    except OSError:
        pass
EOF
)
  [ -z "$left" ] || echo "test-slurm: killed leftover processes: $left" >&2
  # slurmstepd daemonizes: the last job's are reaped by init, which can take a moment.
  for _ in $(seq 50); do pgrep -x slurmstepd >/dev/null || break; sleep 0.2; done
  if [ ${#PIDS[@]} -gt 0 ]; then
    say "stopped ${NAMES[*]}; total $((SECONDS - T0)) s"
  fi
  if [ "${KEEP:-0}" = 1 ] || [ $rc != 0 ]; then
    say "logs and job output kept in $TMP"
  else
    rm -rf "$TMP"
  fi
  [ $rc = 0 ] && say "PASSED" || echo "test-slurm: FAILED (exit $rc)" >&2
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

NODE0=$(hostname -s)
NODE1=$NODE0-1
[ "$NODE0" != localhost ] || fail "this host is named 'localhost', which SLURM reserves"
getent hosts "$NODE0" >/dev/null ||
  fail "this host's name '$NODE0' does not resolve; node 0 (the coordinator) needs it to"
read -r CTLD_PORT PORT0 PORT1 < <("$JAXCOLL_PYTHON" -c '
import socket
socks = [socket.socket() for _ in range(3)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')

mkdir -p "$TMP/munge" "$TMP/state" "$TMP/spool/$NODE0" "$TMP/spool/$NODE1" "$TMP/log"
chmod 755 "$TMP/munge"
head -c 1024 /dev/urandom >"$TMP/munge.key"
chmod 400 "$TMP/munge.key"
SOCKET=$TMP/munge/munge.socket
touch "$TMP/plugstack.conf"
cat >"$TMP/slurm.conf" <<EOF
ClusterName=jaxcolltest
SlurmctldHost=$NODE0(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$SOCKET
CredType=cred/munge
StateSaveLocation=$TMP/state
SlurmdSpoolDir=$TMP/spool/%n
SlurmctldPidFile=$TMP/slurmctld.pid
SlurmdPidFile=$TMP/slurmd.%n.pid
SlurmctldLogFile=$TMP/log/slurmctld.log
SlurmdLogFile=$TMP/log/slurmd.%n.log
PlugStackConfig=$TMP/plugstack.conf
MailProg=/bin/true
# no cgroups: processes tracked through /proc, tasks not bound
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# the CPU counts below, not what slurmd finds (both "nodes" share this host's cores)
SlurmdParameters=config_overrides
ReturnToService=2
# job (f) takes node 1 away: notice it in seconds, not SLURM's default 5 minutes
SlurmdTimeout=10
NodeName=$NODE0 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$PORT0 CPUs=2 State=UNKNOWN
NodeName=$NODE1 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$PORT1 CPUs=2 State=UNKNOWN
PartitionName=test Nodes=$NODE0,$NODE1 Default=YES MaxTime=INFINITE State=UP
EOF
cat >"$TMP/cgroup.conf" <<EOF
CgroupAutomount=no
ConstrainCores=no
ConstrainRAMSpace=no
ConstrainDevices=no
EOF
export SLURM_CONF=$TMP/slurm.conf

start() {  # start NAME COMMAND...: a daemon in the foreground of a background job
  local name=$1
  shift
  "$@" >"$TMP/log/$name.out" 2>&1 &
  PIDS+=($!)
  NAMES+=("$name(pid $!)")
}
wait_for() {  # wait_for WHAT SECONDS COMMAND...
  local what=$1 limit=$2
  shift 2
  for _ in $(seq $((limit * 5))); do
    "$@" >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  fail "$what not ready after ${limit} s; logs in $TMP/log"
}
nodes_idle() { [ "$(sinfo -h -N -o '%N %t' | sort | tr '\n' ' ')" = "$NODE0 idle $NODE1 idle " ]; }

start munged munged -F --key-file="$TMP/munge.key" --socket="$SOCKET" \
  --pid-file="$TMP/munge/munged.pid" --log-file="$TMP/log/munged.log" \
  --seed-file="$TMP/munge/munged.seed"
wait_for munged 20 bash -c "munge -n -S '$SOCKET' | unmunge -S '$SOCKET'"
start slurmctld slurmctld -D -f "$SLURM_CONF"
wait_for slurmctld 30 scontrol ping
start "slurmd-$NODE0" slurmd -D -N "$NODE0" -f "$SLURM_CONF"
start "slurmd-$NODE1" slurmd -D -N "$NODE1" -f "$SLURM_CONF"
wait_for "nodes $NODE0, $NODE1" 60 nodes_idle
say "cluster up in $((SECONDS - T0)) s: slurmctld on 127.0.0.1:$CTLD_PORT, nodes $NODE0" \
  "(:$PORT0) and $NODE1 (:$PORT1) idle; $TMP"

cd "$ROOT"
"$JAXCOLL_PYTHON" -u tests/slurm/jobs.py "$TMP" "$NODE1" &
JOBS_PID=$!
wait "$JOBS_PID"   # in the background, so that SIGINT/SIGTERM reach the trap at once
