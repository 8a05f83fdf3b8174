#!/usr/bin/env node
// Streams a generation from a specmesh gateway (specmesh.v1.Generation/Generate) and prints the text as it arrives.
// The .proto files are loaded at run time from the repository's protos/ folder (includeDirs = the repository root,
// because the protos import each other as "protos/specmesh/v1/...").
//
// From the repository root (protos/README.md; tests/test_node_client.py runs these lines):
//   cd examples/node && npm ci --no-audit --no-fund
//   node examples/node/client.js --addr 127.0.0.1:50051 --max-new-tokens 32 "def fibonacci(n):"
//
// Options: --addr HOST:PORT, --max-new-tokens N, --temperature T, --top-p P, --top-k K, --seed S,
// --num-draft-tokens K, --stop STR (repeatable), --ignore-eos, --chat (send the prompt as a user message),
// --api-key KEY (or $SPECMESH_API_KEY: metadata "authorization: Bearer KEY"), --ca FILE (TLS with this CA),
// --cert FILE --key FILE (mutual TLS), --json (print one JSON summary line instead of streaming the text).
"use strict";

const fs = require("node:fs");
const path = require("node:path");
const { parseArgs } = require("node:util");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTO_ROOT = process.env.SPECMESH_PROTO_ROOT || path.resolve(__dirname, "..", "..");
const PROTO_FILE = "protos/specmesh/v1/generate.proto";

function loadGenerationService() {
  const definition = protoLoader.loadSync(PROTO_FILE, {
    includeDirs: [PROTO_ROOT], keepCase: true, longs: String, enums: String, defaults: true, oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).specmesh.v1.Generation;
}

function parseOptions(argv) {
  const { values, positionals } = parseArgs({
    args: argv, allowPositionals: true, options: {
      addr: { type: "string", default: "127.0.0.1:50051" },
      "max-new-tokens": { type: "string", default: "64" },
      temperature: { type: "string", default: "0" },
      "top-p": { type: "string", default: "0" },
      "top-k": { type: "string", default: "0" },
      seed: { type: "string" },
      "num-draft-tokens": { type: "string" },
      stop: { type: "string", multiple: true, default: [] },
      "ignore-eos": { type: "boolean", default: false },
      chat: { type: "boolean", default: false },
      "api-key": { type: "string", default: process.env.SPECMESH_API_KEY || "" },
      ca: { type: "string" }, cert: { type: "string" }, key: { type: "string" },
      json: { type: "boolean", default: false },
    },
  });
  if (positionals.length !== 1) throw new Error("expected exactly one prompt argument");
  return { ...values, prompt: positionals[0] };
}

// "FINISH_REASON_STOP_STRING" -> "stop string" (the words `specmesh generate` prints).
function finishReasonWords(name) {
  return String(name || "").replace(/^FINISH_REASON_/, "").toLowerCase().replace(/_/g, " ");
}

function buildRequest(o) {
  const sampling = { temperature: Number(o.temperature), top_p: Number(o["top-p"]), top_k: Number(o["top-k"]) };
  if (o.seed !== undefined) sampling.seed = o.seed;
  const request = {
    prompt: o.chat ? "" : o.prompt, messages: o.chat ? [{ role: "user", content: o.prompt }] : [],
    sampling, max_new_tokens: Number(o["max-new-tokens"]), stop: o.stop, ignore_eos: o["ignore-eos"],
  };
  if (o["num-draft-tokens"] !== undefined) request.num_draft_tokens = Number(o["num-draft-tokens"]);
  return request;
}

function credentials(o) {
  if (!o.ca) return grpc.credentials.createInsecure();
  const read = (f) => (f ? fs.readFileSync(f) : null);
  return grpc.credentials.createSsl(read(o.ca), read(o.key), read(o.cert));
}

function generate(o) {
  const Generation = loadGenerationService();
  const client = new Generation(o.addr, credentials(o));
  const metadata = new grpc.Metadata();
  if (o["api-key"]) metadata.set("authorization", `Bearer ${o["api-key"]}`);
  const summary = { text: "", token_ids: [], finish_reason: "", usage: null, request_id: "" };
  return new Promise((resolve, reject) => {
    const call = client.Generate(buildRequest(o), metadata);
    call.on("data", (response) => {
      summary.text += response.text;
      summary.token_ids.push(...response.token_ids);
      summary.request_id = response.request_id;
      if (!o.json && response.text) process.stdout.write(response.text);
      if (response.usage) { summary.usage = response.usage; summary.finish_reason = response.finish_reason; }
    });
    call.on("error", (err) => { client.close(); reject(err); });
    call.on("end", () => { client.close(); resolve(summary); });
  });
}

async function main() {
  const options = parseOptions(process.argv.slice(2));
  const summary = await generate(options);
  if (options.json) {
    process.stdout.write(JSON.stringify(summary) + "\n");
  } else {
    const u = summary.usage || {};
    process.stderr.write(`\n[${u.completion_tokens} tokens, ${u.num_rounds} rounds, acceptance ` +
      `${Number(u.acceptance_rate || 0).toFixed(2)}, finish ${finishReasonWords(summary.finish_reason)}]\n`);
  }
}

main().catch((err) => {
  const status = typeof err.code === "number" ? `${grpc.status[err.code]}: ` : "";
  process.stderr.write(`error: ${status}${err.details || err.message}\n`);
  process.exit(1);
});
