#!/bin/bash
# Node 1 of 2: the scheduler and workers 0-3 (the msrun manual's msrun_1.sh, on random data).
# Set MASTER_ADDR to node 1's IP address; run msrun_2.sh on node 2 with the same value.
# Both scripts may also run on one machine (MASTER_ADDR=127.0.0.1, the default): two msrun
# invocations then form one 8-rank job over loopback.
cd "$(dirname "$0")" || exit 1
MSRUN=${MSRUN:-pmsrun}  # this project's msrun; MSRUN=msrun runs the same job under MindSpore's
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
LOG_DIR=${LOG_DIR:-msrun_log}
mkdir -p "$LOG_DIR"
echo "start training"

"$MSRUN" --worker_num=8 --local_worker_num=4 --master_addr="$MASTER_ADDR" --master_port=8118 --node_rank=0 --log_dir="$LOG_DIR" --join=True --cluster_time_out=300 net.py
