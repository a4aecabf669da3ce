#!/bin/bash
# One node, 8 workers plus the scheduler (the msrun manual's msrun_single.sh, on random data).
cd "$(dirname "$0")" || exit 1
MSRUN=${MSRUN:-pmsrun}  # this project's msrun; MSRUN=msrun runs the same job under MindSpore's
rm -rf msrun_log
mkdir msrun_log
echo "start training"

"$MSRUN" --worker_num=8 --local_worker_num=8 --master_port=8118 --log_dir=msrun_log --join=True --cluster_time_out=300 net.py
