#!/bin/bash
# G2 end-site rows of docs/benchmarks/sparse.md: model run dir $1, label $2, test split of shards
# with end sites (/tmp/cmu_es: python -m data_prep.bvh_to_shards --input=../shared/data/cmu
# --rig=cmu_body --output=/tmp/cmu_es). docs/benchmarks/endsites_table.py makes the table.
set -e
RUN=$1; L=$2; O=outputs/g2; D=${DATA:-/tmp/cmu_es}
mkdir -p $O
ev() { name=$1; shift; [ -f $O/${L}_$name.json ] || nice python -m experiments.evaluate --data=$D --split=test --method=ikgat --checkpoint=$RUN --output_json=$O/${L}_$name.json "$@" > /dev/null 2>&1; echo "$L $name done"; }
ev full
ev full_es --end_sites
ev full_oxr --orientations=Head,LeftHand,RightHand
ev full_es_oxr --end_sites --orientations=Head,LeftHand,RightHand
ev t6_o6 --trackers=6 --orientations=Hips,Head,LeftHand,RightHand,LeftFoot,RightFoot
ev t6_es_o6 --trackers=6 --end_sites --orientations=Hips,Head,LeftHand,RightHand,LeftFoot,RightFoot
