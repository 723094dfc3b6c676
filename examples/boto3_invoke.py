"""Call an lmi-serve SageMaker endpoint with boto3: one JSON answer, then a token stream.

    python examples/boto3_invoke.py --endpoint-name my-endpoint --region us-east-1
    python examples/boto3_invoke.py --endpoint-url http://localhost:8080   # a local server

A local lmi-serve answers SageMaker's runtime API itself (`/endpoints/{name}/invocations` and
`.../invocations-response-stream`), so `--endpoint-url` is all it takes to test without AWS.

An endpoint configured with `option.output_formatter=sse` (or `jsonlines`) answers every LMI
request in that format, `"stream": false` and `Accept: application/json` included, as DJL LMI
does (its formatter, not the Accept header, decides): `invoke` reads the text from the answer's
last event then.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import boto3
from botocore import UNSIGNED
from botocore.config import Config


class LineIterator:
    """The whole lines of an `invoke_endpoint_with_response_stream` body, as bytes without "\\n".

    SageMaker cuts a response stream into PayloadParts wherever it likes: a part may end in the
    middle of a line or carry several lines. This joins the parts back into the lines the model
    server wrote. Error events need no handling here: botocore raises them while iterating.
    """

    def __init__(self, events: Iterable[Mapping[str, Any]]) -> None:
        self._events = events

    def __iter__(self) -> Iterator[bytes]:
        pending = b""
        for event in self._events:
            chunk = event["PayloadPart"]["Bytes"]
            pending += chunk
            if b"\n" in chunk:
                *lines, pending = pending.split(b"\n")
                yield from lines
        if pending:
            yield pending


def json_lines(lines: Iterable[bytes]) -> Iterator[dict]:
    """Each non-blank line as JSON; SSE's `data:` prefix is dropped, so either formatter works."""
    for line in lines:
        line = line.strip()
        line = line[len(b"data:") :] if line.startswith(b"data:") else line
        if line:
            yield json.loads(line)


def request_body(prompt: str, max_new_tokens: int, stream: bool = False) -> bytes:
    """An LMI request (DJL LMI's input/output schema)."""
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens}, "stream": stream}
    return json.dumps(body).encode()


def runtime_client(endpoint_url: str | None, region: str | None):
    """A `sagemaker-runtime` client; `endpoint_url` points it at a local server."""
    session = boto3.Session(region_name=region)
    # A local lmi-serve checks no signature: a machine with no AWS credentials can still call it.
    unsigned = endpoint_url is not None and session.get_credentials() is None
    return session.client(
        "sagemaker-runtime",
        region_name=session.region_name or "us-east-1",
        endpoint_url=endpoint_url,
        config=Config(signature_version=UNSIGNED) if unsigned else None,
    )


def invoke(runtime, endpoint_name: str, prompt: str, max_new_tokens: int) -> str:
    """`invoke_endpoint`: the whole generated text at once, from a JSON answer or, where the
    endpoint's formatter streams every answer, from its last event."""
    response = runtime.invoke_endpoint(
        EndpointName=endpoint_name,
        Body=request_body(prompt, max_new_tokens),
        ContentType="application/json",
        Accept="application/json",
    )
    body = response["Body"].read()
    if response["ContentType"].split(";")[0] == "application/json":
        return json.loads(body)["generated_text"]
    return list(json_lines(body.splitlines()))[-1]["generated_text"]


def stream_tokens(runtime, endpoint_name: str, prompt: str, max_new_tokens: int) -> Iterator[str]:
    """`invoke_endpoint_with_response_stream`: each token's text as the model produces it."""
    response = runtime.invoke_endpoint_with_response_stream(
        EndpointName=endpoint_name,
        Body=request_body(prompt, max_new_tokens, stream=True),
        ContentType="application/json",
    )
    for record in json_lines(LineIterator(response["Body"])):
        yield record["token"]["text"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--endpoint-url", help="e.g. http://localhost:8080 (default: AWS)")
    parser.add_argument("--endpoint-name", default="lmi-serve", help="default: lmi-serve")
    parser.add_argument("--region", help="default: your AWS configuration's, else us-east-1")
    parser.add_argument("--prompt", default="What is Deep Learning?")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    runtime = runtime_client(args.endpoint_url, args.region)
    request = (args.endpoint_name, args.prompt, args.max_new_tokens)
    print("invoke_endpoint:", invoke(runtime, *request))
    print("invoke_endpoint_with_response_stream: ", end="", flush=True)
    for text in stream_tokens(runtime, *request):
        print(text, end="", flush=True)
    print()


if __name__ == "__main__":
    main()
