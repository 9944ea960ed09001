// A client that knows only serving/proto/inkling.proto: it loads the .proto at run time with
// @grpc/proto-loader (no generated code) and calls the server with @grpc/grpc-js.
//
//   node client.js HOST:PORT CALLS.json
//
// CALLS.json is a list of {"method": "Generate" | "Tokenize" | "Detokenize" | "GetModelInfo", "request": {...}}
// with field names as in the .proto. Prints a JSON list with, for each call, {"responses": [...]} (every
// streamed message, or the one reply) or {"error": {"code": NAME, "details": MESSAGE}}.
"use strict";

const fs = require("fs");
const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTO = path.join(__dirname, "..", "..", "serving", "proto", "inkling.proto");
const STATUS_NAMES = Object.fromEntries(Object.entries(grpc.status).map(([name, code]) => [code, name]));

function call(client, method, request) {
  return new Promise((resolve) => {
    const fail = (error) => resolve({ error: { code: STATUS_NAMES[error.code], details: error.details } });
    if (method === "Generate") {
      const responses = [];
      const stream = client.Generate(request);
      stream.on("data", (response) => responses.push(response));
      stream.on("error", fail);
      stream.on("end", () => resolve({ responses }));
    } else {
      client[method](request, (error, response) => (error ? fail(error) : resolve({ responses: [response] })));
    }
  });
}

async function main() {
  const [address, callsPath] = process.argv.slice(2);
  const definition = protoLoader.loadSync(PROTO, { keepCase: true, longs: Number, enums: String, defaults: true });
  const { Inkling } = grpc.loadPackageDefinition(definition).inkling.v1;
  const client = new Inkling(address, grpc.credentials.createInsecure());
  const results = [];
  for (const { method, request } of JSON.parse(fs.readFileSync(callsPath, "utf8"))) {
    results.push(await call(client, method, request));
  }
  client.close();
  process.stdout.write(JSON.stringify(results));
}

main().catch((error) => {
  console.error(error);
  process.exit(1);
});
