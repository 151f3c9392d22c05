// A Node client built from pacer.proto alone (stock @grpc/grpc-js + @grpc/proto-loader): submits a group,
// collects it and the group the Python side submitted, and leaves one group for the Python side to read.
// Usage: node roundtrip.js ADDRESS PROTO_ROOT. Prints one JSON line: what it collected and whether its own
// group came back as sent.
'use strict';
const path = require('path');
const grpc = require('@grpc/grpc-js');
const loader = require('@grpc/proto-loader');

const [address, protoRoot] = process.argv.slice(2);
const definition = loader.loadSync('coda/pacer/v1/pacer.proto', {
  keepCase: true, longs: String, enums: String, defaults: true, includeDirs: [path.resolve(protoRoot)],
});
const v1 = grpc.loadPackageDefinition(definition).coda.pacer.v1;
const client = new v1.RolloutPacer(address, grpc.credentials.createInsecure());
const call = (method, request) => new Promise((resolve, reject) =>
  client[method](request, {deadline: Date.now() + 20000}, (error, answer) => (error ? reject(error) : resolve(answer))));

const ARRAYS = {
  token_ids: [0, 1, -5, 2147483647, -2147483648],
  logprobs: [-0.5, -1.25, 0, -3.5, NaN],
  loss_mask: [1, 0, 1, 1, 0],
};

function group(promptId) {
  return [0, 1].map((i) => ({
    trajectory_id: `${promptId}/${i}`, prompt_id: promptId, status: 'TRAJECTORY_STATUS_COMPLETED', reward: i + 0.5,
    ...ARRAYS, start_weight_version: 3, end_weight_version: 4, metadata: {from: 'node'}, payload: Buffer.from([0, 255]),
  }));
}

const sameNumbers = (a, b) => a.length === b.length && a.every((x, i) => Object.is(x, b[i]));
const plain = (values) => values.map((x) => (Number.isNaN(x) ? 'NaN' : x));

async function main() {
  await call('Dispatch', {candidates: [{prompt_id: 'node-1'}, {prompt_id: 'node-2'}]});
  await call('Submit', {trajectories: group('node-1'), request_id: 'node-submit-1'});
  const collected = await call('Collect', {num_groups: 2, wait_seconds: 10});
  await call('Submit', {trajectories: group('node-2'), request_id: 'node-submit-2'});
  const mine = collected.groups.find((g) => g.prompt_id === 'node-1');
  const sent = group('node-1');
  const roundTripped = mine !== undefined && mine.trajectories.length === 2 && mine.trajectories.every((t, i) =>
    t.trajectory_id === sent[i].trajectory_id && t.reward === sent[i].reward &&
    sameNumbers(t.token_ids, ARRAYS.token_ids) && sameNumbers(t.loss_mask, ARRAYS.loss_mask) &&
    sameNumbers(t.logprobs, ARRAYS.logprobs.map(Math.fround)) && t.metadata.from === 'node' &&
    t.payload.equals(sent[i].payload) && t.start_weight_version === '3' && t.end_weight_version === '4');
  console.log(JSON.stringify({
    round_tripped: roundTripped,
    order: collected.groups.map((g) => g.prompt_id),
    groups: collected.groups.map((g) => ({
      prompt_id: g.prompt_id,
      trajectories: g.trajectories.map((t) => ({
        trajectory_id: t.trajectory_id, token_ids: t.token_ids, logprobs: plain(t.logprobs), loss_mask: t.loss_mask,
      })),
    })),
  }));
  client.close();
}

main().catch((error) => { console.error(error); process.exit(1); });
