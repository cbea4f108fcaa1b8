// A solved clip as three.js (https://threejs.org) reads it, for tests/threejs_test.py.
//
//   node three_read.mjs glb|bvh|fbx FILE FRAME[,FRAME...]
//
// Loads FILE with three.js's own loader (GLTFLoader, BVHLoader or FBXLoader), plays its first
// animation clip once with an AnimationMixer at the time of key FRAME of its first track (the
// key's own float32 time, so no key is blended with the next) for each FRAME, and prints one
// JSON object: the joints (three's name, the name in the file where three keeps it, the parent
// joint), the clip's tracks (name, number of keys, first and last key time), and per frame every
// joint's world position and world quaternion (x, y, z, w) and, for a skinned mesh, every
// vertex's bind-pose position, its joints and weights, and its skinned world position, as
// three.js computes them (SkinnedMesh.getVertexPosition, the CPU form of its skinning shader).
import fs from 'node:fs';
import * as THREE from 'three';
import { BVHLoader } from 'three/addons/loaders/BVHLoader.js';
import { FBXLoader } from 'three/addons/loaders/FBXLoader.js';
import { GLTFLoader } from 'three/addons/loaders/GLTFLoader.js';

const [kind, file, framesText] = process.argv.slice(2);
const frames = framesText.split(',').map(Number);
const bytes = fs.readFileSync(file);
const arrayBuffer = bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.byteLength);

async function load() {
  if (kind === 'glb') {
    const gltf = await new GLTFLoader().parseAsync(arrayBuffer, '');
    const nodeIndex = (o) => gltf.parser.associations.get(o)?.nodes;
    return { root: gltf.scene, clip: gltf.animations[0], fileName: (o) => nodeIndex(o) };
  }
  if (kind === 'bvh') {
    const bvh = new BVHLoader().parse(bytes.toString('utf8'));
    const root = new THREE.Group();
    root.add(bvh.skeleton.bones[0]);
    return { root, clip: bvh.clip, fileName: () => undefined };
  }
  if (kind === 'fbx') {
    const root = new FBXLoader().parse(arrayBuffer, '');
    return { root, clip: root.animations[0], fileName: () => undefined };
  }
  throw new Error(`unknown kind ${kind}`);
}

const { root, clip, fileName } = await load();
const bones = [];
let skinned = null;
root.traverse((o) => {
  if (o.isBone) bones.push(o);
  if (o.isSkinnedMesh && skinned === null) skinned = o;
});
const mixer = new THREE.AnimationMixer(root);
const action = mixer.clipAction(clip);
action.setLoop(THREE.LoopOnce);  // the last key's time is the clip's end: held, not wrapped
action.clampWhenFinished = true;
action.play();

const out = {
  joints: bones.map((b) => ({
    name: b.name,
    node: fileName(b) ?? null,
    parent: b.parent && b.parent.isBone ? b.parent.name : null,
  })),
  duration: clip.duration,
  tracks: clip.tracks.map((t) => ({
    name: t.name, keys: t.times.length, first: t.times[0], last: t.times[t.times.length - 1],
  })),
  frames: [],
};
const v = new THREE.Vector3();
const q = new THREE.Quaternion();
let bind = null;
if (skinned !== null) {
  const g = skinned.geometry.attributes;
  const position = [];  // bind pose, world: the mesh's own transform at bind time applied
  for (let i = 0; i < g.position.count; i++) {
    position.push(...v.fromBufferAttribute(g.position, i).applyMatrix4(skinned.bindMatrix)
      .toArray());
  }
  bind = { position, joints: Array.from(g.skinIndex.array),
           weights: Array.from(g.skinWeight.array),
           bones: skinned.skeleton.bones.map((b) => bones.indexOf(b)) };
}
out.bind = bind;
for (const frame of frames) {
  mixer.setTime(clip.tracks[0].times[frame]);
  root.updateMatrixWorld(true);
  const entry = { frame, time: clip.tracks[0].times[frame], position: [], quaternion: [],
                  skinned: null };
  for (const b of bones) {
    b.getWorldPosition(v);
    b.getWorldQuaternion(q);
    entry.position.push(v.toArray());
    entry.quaternion.push(q.toArray());
  }
  if (skinned !== null) {
    const n = skinned.geometry.attributes.position.count;
    entry.skinned = [];
    for (let i = 0; i < n; i++) {
      skinned.getVertexPosition(i, v);
      entry.skinned.push(v.applyMatrix4(skinned.matrixWorld).toArray());
    }
  }
  out.frames.push(entry);
}
process.stdout.write(JSON.stringify(out));
