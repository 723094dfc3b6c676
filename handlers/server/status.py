"""Which status each error kind gets on the wire: the tables more than one module answers with.

HTTP answers OpenAI, embeddings, Databricks, KServe, generate and the SageMaker routes with
`HTTP`; LMI answers with its own (`LMI_HTTP`: DJL Serving answers failed validation and failed
inference with 424), which DJL's front end also sends for the records of the DJL entry. gRPC
(KServe V2) answers with status codes (`GRPC`). A protocol with statuses of its own keeps its
table beside its routes (TGI's, Anthropic's: built over `HTTP`).
"""

from __future__ import annotations

from types import MappingProxyType

from grpc import StatusCode

from handlers.protocols.errors import ErrorKind

Table = MappingProxyType

HTTP: Table[ErrorKind, int] = MappingProxyType({
    ErrorKind.VALIDATION: 400,
    ErrorKind.SESSION: 400,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.TIMEOUT: 408,
    ErrorKind.SLOW_BODY: 408,
    ErrorKind.TOO_LARGE: 413,
    ErrorKind.FAILED: 500,
    ErrorKind.INTERNAL: 500,
    ErrorKind.UNSUPPORTED: 501,
    ErrorKind.OVERLOADED: 503,
    ErrorKind.UNAVAILABLE: 503,
})
LMI_HTTP: Table[ErrorKind, int] = MappingProxyType(
    {**HTTP, ErrorKind.VALIDATION: 424, ErrorKind.FAILED: 424})

RETRY_AFTER_SECONDS = 1  # what an overloaded server tells its clients to wait

GRPC: Table[ErrorKind, StatusCode] = MappingProxyType({
    ErrorKind.VALIDATION: StatusCode.INVALID_ARGUMENT,
    ErrorKind.SESSION: StatusCode.INVALID_ARGUMENT,
    ErrorKind.NOT_FOUND: StatusCode.NOT_FOUND,
    ErrorKind.TIMEOUT: StatusCode.DEADLINE_EXCEEDED,
    ErrorKind.SLOW_BODY: StatusCode.DEADLINE_EXCEEDED,  # never: gRPC reads whole messages
    ErrorKind.TOO_LARGE: StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.FAILED: StatusCode.INTERNAL,
    ErrorKind.INTERNAL: StatusCode.INTERNAL,
    ErrorKind.UNSUPPORTED: StatusCode.UNIMPLEMENTED,
    ErrorKind.OVERLOADED: StatusCode.UNAVAILABLE,
    ErrorKind.UNAVAILABLE: StatusCode.UNAVAILABLE,
})
