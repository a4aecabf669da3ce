#!/bin/bash
# Node 2 of 2: workers 4-7 (the msrun manual's msrun_2.sh, on random data).
cd "$(dirname "$0")" || exit 1
MSRUN=${MSRUN:-pmsrun}  # this project's msrun; MSRUN=msrun runs the same job under MindSpore's
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
LOG_DIR=${LOG_DIR:-msrun_log}
mkdir -p "$LOG_DIR"
echo "start training"

"$MSRUN" --worker_num=8 --local_worker_num=4 --master_addr="$MASTER_ADDR" --master_port=8118 --node_rank=1 --log_dir="$LOG_DIR" --join=True --cluster_time_out=300 net.py
