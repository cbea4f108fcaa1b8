// The Khronos glTF validator (https://github.com/KhronosGroup/glTF-Validator) on one .glb, for
// tests/threejs_test.py: `node validate.mjs FILE` prints its report as JSON.
import fs from 'node:fs';
import * as validator from 'gltf-validator';

const report = await validator.validateBytes(new Uint8Array(fs.readFileSync(process.argv[2])),
                                             { maxIssues: 1000 });
process.stdout.write(JSON.stringify(report));
