#!/usr/bin/env bash
# Start a Slurm cluster on this machine for the tests, advertising fake GPUs
# so that GPU requests from profiles/slurm are really scheduled: the node
# named after the host (partition debug, the default); a twin of it, its own
# slurmd on its own port (partition debug2: `make test` runs its tests in two
# processes, each submitting to a partition of its own, so that neither's
# jobs wait behind the other's); and two more slurmd daemons posing as two
# nodes of partition twonodes, for jobs over several nodes (resources.nodes).
# Idempotent: a second run with the daemons up only waits for the node.
# Needs root (apt-get, /etc/slurm, /run). Not for real clusters.
set -euo pipefail

NGPUS=${SHARDGEN_TEST_GPUS:-2}
host=$(hostname)

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null
fi

# munge: shared-key authentication between the Slurm daemons and clients.
if [ ! -s /etc/munge/munge.key ]; then
  mungekey -c -f -k /etc/munge/munge.key
  chown munge:munge /etc/munge/munge.key 2>/dev/null || true
  chmod 400 /etc/munge/munge.key
fi
mkdir -p /run/munge && chown munge:munge /run/munge 2>/dev/null || true
if ! pgrep -x munged >/dev/null; then
  runuser -u munge -- munged 2>/dev/null || munged --force
fi

# Fake GPU devices: character devices (same as /dev/null), which gres.conf
# accepts; regular files are refused.
mkdir -p /run/fakegpu
for i in $(seq 0 $((2 * NGPUS + 1))); do
  [ -e /run/fakegpu/gpu$i ] || mknod /run/fakegpu/gpu$i c 1 3
done

cpus=$(nproc)
# Leave 2 GiB to the system.
mem_mb=$(( $(awk '/MemTotal/ {print int($2/1024)}' /proc/meminfo) - 2048 ))
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
conf=$(cat <<CONF
ClusterName=shardgen-test
SlurmctldHost=${host}
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
GresTypes=gpu
# Finished jobs stay visible to squeue, which the executor plugin polls.
MinJobAge=900
# 10,000 shards held in the queue at once (the benchmark submits that many); the default is 10,000 in all.
MaxJobCount=20000
KillWait=30
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd-%n.log
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd-%n.pid
ReturnToService=2
NodeName=${host} CPUs=${cpus} RealMemory=${mem_mb} Gres=gpu:${NGPUS} State=UNKNOWN
NodeName=${host}-b NodeHostname=${host} NodeAddr=127.0.0.1 Port=6833 CPUs=${cpus} RealMemory=${mem_mb} Gres=gpu:${NGPUS} State=UNKNOWN
NodeName=${host}-n0 NodeHostname=${host} NodeAddr=127.0.0.1 Port=6831 CPUs=${cpus} RealMemory=$((mem_mb / 2)) Gres=gpu:1 State=UNKNOWN
NodeName=${host}-n1 NodeHostname=${host} NodeAddr=127.0.0.1 Port=6832 CPUs=${cpus} RealMemory=$((mem_mb / 2)) Gres=gpu:1 State=UNKNOWN
PartitionName=debug Nodes=${host} Default=YES MaxTime=INFINITE State=UP
PartitionName=debug2 Nodes=${host}-b MaxTime=INFINITE State=UP
PartitionName=twonodes Nodes=${host}-n0,${host}-n1 MaxTime=INFINITE State=UP
CONF
)
gres="NodeName=${host} Name=gpu File=/run/fakegpu/gpu[0-$((NGPUS - 1))]
NodeName=${host}-n0 Name=gpu File=/run/fakegpu/gpu${NGPUS}
NodeName=${host}-n1 Name=gpu File=/run/fakegpu/gpu$((NGPUS + 1))
NodeName=${host}-b Name=gpu File=/run/fakegpu/gpu[$((NGPUS + 2))-$((2 * NGPUS + 1))]"
nodes="${host} ${host}-b ${host}-n0 ${host}-n1"
changed=0
if [ "$(cat /etc/slurm/slurm.conf 2>/dev/null)" != "$conf" ]; then
  echo "$conf" >/etc/slurm/slurm.conf; changed=1
fi
if [ "$(cat /etc/slurm/gres.conf 2>/dev/null)" != "$gres" ]; then
  echo "$gres" >/etc/slurm/gres.conf; changed=1
fi
if [ $changed = 1 ]; then
  pkill -x slurmctld 2>/dev/null || true
  pkill -x slurmd 2>/dev/null || true
  # slurmctld saves its state before it exits: wait, or it is not restarted below
  for _ in $(seq 30); do { pgrep -x slurmctld || pgrep -x slurmd; } >/dev/null || break; sleep 1; done
fi
pgrep -x slurmctld >/dev/null || slurmctld
for node in $nodes; do
  mkdir -p "/var/spool/slurmd/$node"
  pgrep -f "^slurmd -N $node\$" >/dev/null || slurmd -N "$node"
done

for node in $nodes; do
  for _ in $(seq 60); do
    state=$(sinfo -h -n "$node" -o %t 2>/dev/null | head -1 || true)
    case "$state" in
      idle|mix|alloc) echo "slurm: node $node $state"; continue 2 ;;
      down*|drain*) scontrol update nodename="$node" state=resume 2>/dev/null || true ;;
    esac
    sleep 1
  done
  echo "slurm: node $node did not become idle (state: ${state:-none})" >&2
  tail -20 /var/log/slurm/slurmctld.log "/var/log/slurm/slurmd-$node.log" >&2 || true
  exit 1
done
echo "slurm: node $host: ${cpus} CPUs, ${mem_mb} MiB, ${NGPUS} GPUs (partition debug), its twin $host-b (partition debug2); $host-n0 and $host-n1 (partition twonodes)"
