#!/bin/bash
# G2 sparse-input sweep: one model (run dir $1), label $2, test split, every row of docs/benchmarks/sparse.md.
set -e
RUN=$1; L=$2; O=outputs/g2; MF=${MAX_FRAMES:-12000}
ev() { name=$1; shift; [ -f $O/${L}_$name.json ] || nice python -m experiments.evaluate --data=/tmp/cmu --split=test --method=ikgat --checkpoint=$RUN --max_frames=$MF --output_json=$O/${L}_$name.json "$@" > /dev/null 2>&1; echo "$L $name done"; }
ev full
[ "$L" = baseline ] && exit 0
ev t10 --trackers=10
ev t6 --trackers=6
for p in 0.1 0.2 0.3 0.5; do ev drop$p --joint_dropout=$p; done
ev full_oxr --orientations=Head,LeftHand,RightHand
ev t10_oxr --trackers=10 --orientations=Head,LeftHand,RightHand
ev t6_oxr --trackers=6 --orientations=Head,LeftHand,RightHand
ev t6_o6 --trackers=6 --orientations=Hips,Head,LeftHand,RightHand,LeftFoot,RightFoot
ev full_o6 --orientations=Hips,Head,LeftHand,RightHand,LeftFoot,RightFoot
