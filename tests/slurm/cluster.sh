#!/usr/bin/env bash
# A real one-node SLURM cluster on localhost, with accounting and two fake GPUs,
# for testing the workflow's SLURM profile (see ../../README.md, "On a SLURM cluster").
#
#   tests/slurm/cluster.sh check           exit 0 if this machine can run it, else print why
#   tests/slurm/cluster.sh install         Debian packages (slurmctld slurmd slurmdbd munge mariadb)
#   tests/slurm/cluster.sh start STATE     write configs under STATE, start the daemons
#   tests/slurm/cluster.sh stop STATE      stop exactly the daemons `start` started
#
# Needs root and apt-get (Debian 12 / SLURM 22.05); no systemd. Facts behind the
# choices: ../../../shared/DESIGN.md section 5. SLURM reads /etc/slurm/slurm.conf
# inside jobs whatever SLURM_CONF says, so `start` links the config files there
# (refusing to replace files it did not create) and `stop` removes the links.
set -euo pipefail

ETC=/etc/slurm
LINKED=(slurm.conf slurmdbd.conf gres.conf)
PACKAGES=(slurmctld slurmd slurm-client slurmdbd munge mariadb-server)

say() { echo "[slurm-cluster] $*" >&2; }

check() {
    [[ $(id -u) == 0 ]] || { echo "not root: cannot install or run SLURM daemons"; return 1; }
    command -v apt-get >/dev/null || { echo "no apt-get: cannot install SLURM from Debian packages"; return 1; }
    for name in "${LINKED[@]}"; do
        if [[ -e $ETC/$name && ! -L $ETC/$name ]]; then
            echo "$ETC/$name exists and is not ours: this machine has its own SLURM; not touching it"
            return 1
        fi
    done
    if pgrep -x slurmctld >/dev/null || pgrep -x slurmd >/dev/null; then
        echo "slurmctld or slurmd is already running on this machine; not starting another"
        return 1
    fi
}

install() {
    local missing=()
    for package in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "ok installed" || missing+=("$package")
    done
    if ((${#missing[@]})); then
        say "installing ${missing[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq >/dev/null || true
        apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
}

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
    local seconds=$1 what=$2
    shift 2
    for _ in $(seq $((seconds * 4))); do
        "$@" >/dev/null 2>&1 && return 0
        sleep 0.25
    done
    say "timed out waiting for $what"
    return 1
}

write_configs() {
    local state=$1 cpus memory
    cpus=$(nproc)
    # Twice this machine's memory (config_overrides: slurmd does not drain the node for it). The model
    # rules ask for 16 GB each and use about 2; with the real 24 GB only one ran at a time, which
    # doubled the test's time. Nothing enforces the requests here (task/none, no cgroups).
    memory=$(( 2 * $(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p') ))
    mkdir -p "$state"/{ctld,spool,log,run,dev}
    # Two "GPUs": character devices like /dev/null. SLURM only needs files to hand out.
    for i in 0 1; do
        [[ -e $state/dev/gpu$i ]] || mknod "$state/dev/gpu$i" c 1 3
    done
    cat >"$state/slurm.conf" <<EOF
ClusterName=attnlab
SlurmctldHost=localhost
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SlurmdParameters=config_overrides
MailProg=/bin/true
ReturnToService=2
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/spool
SlurmctldPidFile=$state/run/slurmctld.pid
SlurmdPidFile=$state/run/slurmd.pid
SlurmctldLogFile=$state/log/slurmctld.log
SlurmdLogFile=$state/log/slurmd.log
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStorageTRES=gres/gpu
AccountingStoreFlags=job_comment
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MinJobAge=300
GresTypes=gpu
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$memory Gres=gpu:2 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
    cat >"$state/gres.conf" <<EOF
NodeName=localhost Name=gpu File=$state/dev/gpu[0-1]
EOF
    cat >"$state/slurmdbd.conf" <<EOF
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=attnlab-test
StorageLoc=slurm_acct_db_attnlab
LogFile=$state/log/slurmdbd.log
PidFile=$state/run/slurmdbd.pid
EOF
    chmod 600 "$state/slurmdbd.conf"
    for name in "${LINKED[@]}"; do
        ln -sfn "$state/$name" "$ETC/$name"
    done
}

record() {  # record STATE NAME PID
    echo "$3 $2" >>"$1/pids"
}

start() {
    local state=$1
    check >/dev/null || { check; exit 1; }
    mkdir -p "$state" && : >>"$state/pids"
    write_configs "$state"

    if ! pgrep -x munged >/dev/null; then
        mkdir -p /run/munge && chown munge:munge /run/munge
        runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/munged.pid
        wait_for 10 munged test -s /run/munge/munged.pid
        record "$state" munged "$(cat /run/munge/munged.pid)"
    fi

    if ! pgrep -x mariadbd >/dev/null; then
        mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld
        /usr/sbin/mariadbd --user=mysql --pid-file=/run/mysqld/attnlab-test.pid \
            --socket=/run/mysqld/mysqld.sock --skip-networking=0 --bind-address=127.0.0.1 \
            >"$state/log/mariadb.log" 2>&1 &
        wait_for 30 mariadb mysqladmin --socket=/run/mysqld/mysqld.sock ping
        record "$state" mariadbd "$(cat /run/mysqld/attnlab-test.pid)"
    fi
    mysql --socket=/run/mysqld/mysqld.sock <<EOF
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'attnlab-test';
GRANT ALL ON slurm_acct_db_attnlab.* TO 'slurm'@'localhost';
EOF

    /usr/sbin/slurmdbd
    wait_for 20 slurmdbd test -s "$state/run/slurmdbd.pid"
    record "$state" slurmdbd "$(cat "$state/run/slurmdbd.pid")"
    wait_for 20 "slurmdbd to answer" sacctmgr -n list cluster
    sacctmgr -i add cluster attnlab >/dev/null 2>&1 || true
    sacctmgr -i add account attnlab Description=test Organization=attnlab >/dev/null 2>&1 || true
    sacctmgr -i add user root Account=attnlab DefaultAccount=attnlab >/dev/null 2>&1 || true

    /usr/sbin/slurmctld
    wait_for 20 slurmctld test -s "$state/run/slurmctld.pid"
    record "$state" slurmctld "$(cat "$state/run/slurmctld.pid")"
    /usr/sbin/slurmd -N localhost
    wait_for 20 slurmd test -s "$state/run/slurmd.pid"
    record "$state" slurmd "$(cat "$state/run/slurmd.pid")"
    wait_for 30 "the node to be idle" bash -c 'sinfo -h -o %T | grep -qx idle'
    say "up: $(sinfo -h -o '%P %D %T %G')"
}

stop() {
    local state=$1 pid name
    if [[ -f $state/pids ]] && grep -q " slurmctld$" "$state/pids"; then
        scancel --full --signal=KILL --user="$(id -un)" 2>/dev/null || true  # all jobs are ours
    fi
    if [[ -f $state/pids ]]; then
        # Every daemon told at once (one by one, each took 2-4 s to stop: 11 s in all); the cluster
        # and its state folder are thrown away, so the order of shutting down does not matter.
        local -a running=()
        while read -r pid name; do
            if kill -0 "$pid" 2>/dev/null && [[ $(ps -o comm= -p "$pid") == "$name" ]]; then
                kill "$pid" && running+=("$pid:$name")
            fi
        done < "$state/pids"
        for _ in $(seq 40); do
            local alive=0 entry
            for entry in "${running[@]}"; do kill -0 "${entry%%:*}" 2>/dev/null && alive=1; done
            (( alive )) || break
            sleep 0.25
        done
        for entry in "${running[@]}"; do
            kill -0 "${entry%%:*}" 2>/dev/null && kill -9 "${entry%%:*}"
            say "stopped ${entry#*:} (${entry%%:*})"
        done
        rm -f "$state/pids"
    fi
    for name in "${LINKED[@]}"; do
        if [[ -L $ETC/$name && $(readlink "$ETC/$name") == "$state/$name" ]]; then
            rm -f "$ETC/$name"
        fi
    done
}

case "${1:-}" in
    check) check ;;
    install) install ;;
    start) start "${2:?state folder}" ;;
    stop) stop "${2:?state folder}" ;;
    *) echo "usage: $0 check|install|start STATE|stop STATE" >&2; exit 2 ;;
esac
