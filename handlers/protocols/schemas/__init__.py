"""Response (and a few request) bodies as pydantic models, per protocol, for the OpenAPI
document only: the protocols render plain objects and parse with their own models. Request
bodies are the models the protocol modules parse with wherever one exists, so the document
cannot drift from what is accepted."""
