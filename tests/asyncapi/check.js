// Parses AsyncAPI documents with the AsyncAPI project's own parser and prints, as one JSON
// array on stdout, what tests/test_asyncapi_parser.py checks of each: the parser's diagnostics
// and the channels, operations and messages it read, with each message's payload as the
// parser resolved it ($refs replaced). One process for many documents: loading the parser
// costs more than a second.
//
//     node tests/asyncapi/check.js a.json b.json
"use strict";

const fs = require("node:fs");
const { Parser } = require("@asyncapi/parser");

// The parser marks every schema it reads with x-parser-* keys of its own; they are not ours.
const OWN = /^x-parser-/;

// A schema as plain JSON. A schema that contains itself (a recursive definition) is written
// {"$circular": true} where it recurs, as the Python side writes it.
function plain(value, path = new Set()) {
  if (Array.isArray(value)) {
    return value.map((item) => plain(item, path));
  }
  if (value === null || typeof value !== "object") {
    return value;
  }
  if (path.has(value)) {
    return { $circular: true };
  }
  path.add(value);
  const out = {};
  for (const key of Object.keys(value)) {
    if (!OWN.test(key)) {
      out[key] = plain(value[key], path);
    }
  }
  path.delete(value);
  return out;
}

function summary(document) {
  const channels = document.channels().all().map((channel) => ({
    id: channel.id(),
    address: channel.address() ?? null,
    messages: channel.messages().all().map((message) => ({
      id: message.id(),
      payload: message.hasPayload() ? plain(message.payload().json()) : null,
    })),
  }));
  const operations = document.operations().all().map((operation) => ({
    id: operation.id(),
    action: operation.action(),
    channels: operation.channels().all().map((channel) => channel.id()),
    messages: operation.messages().all().map((message) => message.id()),
  }));
  return { channels, operations };
}

async function check(parser, path) {
  const { document, diagnostics } = await parser.parse(fs.readFileSync(path, "utf8"));
  const found = diagnostics.map((d) => ({
    severity: d.severity,
    code: String(d.code),
    path: d.path.map(String),
    message: d.message,
  }));
  return { path, diagnostics: found, ...(document ? summary(document) : {}) };
}

async function main() {
  const parser = new Parser();
  const results = [];
  for (const path of process.argv.slice(2)) {
    results.push(await check(parser, path));
  }
  process.stdout.write(JSON.stringify(results));
}

main().catch((error) => {
  process.stderr.write(`${error.stack || error}\n`);
  process.exit(1);
});
