"""Deploy lmi-serve's image as a SageMaker endpoint with the SageMaker Python SDK v3, then call it.

    pip install sagemaker        # 3.x; this script needs only its core layer, `sagemaker-core`
    python examples/sagemaker_deploy.py --region us-east-1 \\
        --role-arn arn:aws:iam::111122223333:role/SageMakerExecutionRole \\
        --image-uri 111122223333.dkr.ecr.us-east-1.amazonaws.com/lmi-serve:cpu --delete

It creates a model (the image and its LMI environment), an endpoint configuration (instance type
and count) and an endpoint, waits until the endpoint is InService, asks it once for a whole answer
and once for a token stream, and with `--delete` removes all three: an endpoint is billed while it
exists. `--runtime-endpoint-url` sends the invocations elsewhere (a local lmi-serve answers
SageMaker's runtime API too) while the model and endpoint are still created through AWS.
"""

from __future__ import annotations

import argparse
import json
import os

import boto3
from boto3_invoke import request_body, stream_tokens  # the sibling script: examples/ is on sys.path
from sagemaker.core.resources import Endpoint, EndpointConfig, Model
from sagemaker.core.shapes import ContainerDefinition, ProductionVariant

# The AWS SDKs' own per-service endpoint setting: it moves every sagemaker-runtime client made
# afterwards, the SDK's included, and leaves the control plane (`sagemaker`) alone.
RUNTIME_URL_VARIABLE = "AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME"
# DJL LMI's keys (CONTRACT.md): the embedded default model on continuous batching.
DEFAULT_OPTIONS = {"rolling_batch": "auto", "max_rolling_batch_size": "32"}


def lmi_environment(model_id: str | None, options: dict[str, str]) -> dict[str, str]:
    """The container's environment: `option.<name>` as OPTION_<NAME>, the model as HF_MODEL_ID."""
    environment = {"HF_MODEL_ID": model_id} if model_id else {}
    for key, value in options.items():
        environment["OPTION_" + key.removeprefix("option.").upper()] = value
    return environment


def deploy(
    session: boto3.Session,
    *,
    endpoint_name: str,
    image_uri: str,
    role_arn: str,
    environment: dict[str, str],
    instance_type: str,
    instance_count: int = 1,
    model_data: str | None = None,
) -> Endpoint:
    """The model, endpoint configuration and endpoint, each named `endpoint_name`, InService."""
    where = {"session": session, "region": session.region_name}
    container = ContainerDefinition(
        image=image_uri, environment=environment, model_data_url=model_data
    )
    model = Model.create(
        model_name=endpoint_name, primary_container=container, execution_role_arn=role_arn, **where
    )
    variant = ProductionVariant(
        variant_name="AllTraffic",
        model_name=model.model_name,
        instance_type=instance_type,
        initial_instance_count=instance_count,
        # SageMaker restarts a container that does not answer /ping in time; a model loads slowly.
        container_startup_health_check_timeout_in_seconds=600,
    )
    config = EndpointConfig.create(
        endpoint_config_name=endpoint_name, production_variants=[variant], **where
    )
    endpoint = Endpoint.create(
        endpoint_name=endpoint_name, endpoint_config_name=config.endpoint_config_name, **where
    )
    endpoint.wait_for_status("InService")
    return endpoint


def predict(endpoint: Endpoint, prompt: str, max_new_tokens: int) -> str:
    """The SDK's own invocation (`InvokeEndpoint`): the whole generated text."""
    response = endpoint.invoke(
        body=request_body(prompt, max_new_tokens),
        content_type="application/json",
        accept="application/json",
    )
    return json.loads(response.body.read())["generated_text"]


def delete(session: boto3.Session, endpoint_name: str) -> None:
    """Remove what `deploy` created."""
    where = {"session": session, "region": session.region_name}
    Endpoint.get(endpoint_name, **where).delete()
    EndpointConfig.get(endpoint_name, **where).delete()
    Model.get(endpoint_name, **where).delete()


def run(args: argparse.Namespace, session: boto3.Session) -> None:
    """Deploy, invoke twice, and delete when asked."""
    environment = lmi_environment(args.model_id, DEFAULT_OPTIONS | dict(args.option))
    endpoint = deploy(
        session,
        endpoint_name=args.endpoint_name,
        image_uri=args.image_uri,
        role_arn=args.role_arn,
        environment=environment,
        instance_type=args.instance_type,
        instance_count=args.instance_count,
        model_data=args.model_data,
    )
    try:
        print("Endpoint.invoke:", predict(endpoint, args.prompt, args.max_new_tokens))
        # sagemaker-core 2.27's Endpoint.invoke_with_response_stream cannot read any stream (its
        # response transform calls .get() on botocore's EventStream): stream with boto3 itself.
        runtime = session.client("sagemaker-runtime")
        print("invoke_endpoint_with_response_stream: ", end="", flush=True)
        for text in stream_tokens(runtime, args.endpoint_name, args.prompt, args.max_new_tokens):
            print(text, end="", flush=True)
        print()
    finally:
        if args.delete:
            delete(session, args.endpoint_name)


def key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--role-arn", required=True, help="the endpoint's execution role")
    parser.add_argument("--image-uri", required=True, help="lmi-serve's image in ECR")
    parser.add_argument("--region", help="default: your AWS configuration's")
    parser.add_argument("--instance-type", default="ml.m5.xlarge", help="default: ml.m5.xlarge")
    parser.add_argument("--instance-count", type=int, default=1)
    parser.add_argument("--endpoint-name", default="lmi-serve", help="default: lmi-serve")
    parser.add_argument("--model-id", help="HF_MODEL_ID: a model path inside the container")
    parser.add_argument("--model-data", help="s3://…/model.tar.gz, unpacked in /opt/ml/model")
    parser.add_argument("--option", type=key_value, action="append", default=[],
                        metavar="KEY=VALUE", help="an LMI option, sent as OPTION_<KEY>")
    parser.add_argument("--runtime-endpoint-url", help="send the invocations here instead")
    parser.add_argument("--prompt", default="What is Deep Learning?")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--delete", action="store_true", help="delete the endpoint at the end")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.runtime_endpoint_url:
        os.environ[RUNTIME_URL_VARIABLE] = args.runtime_endpoint_url
    run(args, boto3.Session(region_name=args.region))


if __name__ == "__main__":
    main()
