"""Deploy the image with the SageMaker Python SDK's local mode, then invoke it, plainly and as a
stream: SageMaker's own way to try a container on your machine before an endpoint.

    pip install "sagemaker>=2.250,<3" boto3
    python examples/sagemaker_local_mode.py --image-uri lmi-serve:cpu --model-dir ./my-model

Local mode runs the image with docker compose (`docker-compose`, or `docker compose`) as
SageMaker runs it, `serve` with the model directory mounted at /opt/ml/model, on port 8080 (keep
it free). It calls no AWS service: without an account, any region and dummy keys do
(`AWS_DEFAULT_REGION=us-east-1 AWS_ACCESS_KEY_ID=x AWS_SECRET_ACCESS_KEY=x`).

With podman instead of Docker (as this repository's CI runs it), serve podman's Docker API and
point DOCKER_HOST at it, with runc and explicit limits: crun, and podman's defaults for them,
fail on some hosts (apt-get install podman runc docker-compose):

    cat > containers.conf <<'EOF'
    [containers]
    default_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]
    [engine]
    runtime = "runc"
    EOF
    CONTAINERS_CONF=$PWD/containers.conf podman system service --time=0 unix:///tmp/pm.sock &
    export DOCKER_HOST=unix:///tmp/pm.sock

The SDK's local runtime client has no `invoke_endpoint_with_response_stream`, so the stream goes
through boto3 to the container, whose server answers SageMaker's runtime API itself.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import boto3
from boto3_invoke import LineIterator, json_lines
from botocore import UNSIGNED
from botocore.config import Config
from sagemaker.deserializers import JSONDeserializer
from sagemaker.local import LocalSession
from sagemaker.model import Model
from sagemaker.predictor import Predictor
from sagemaker.serializers import JSONSerializer

PROMPT = "<|im_start|>user\nWhat is deep learning?<|im_end|>\n<|im_start|>assistant\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--image-uri", required=True)
    parser.add_argument("--model-dir", type=Path, help="what /opt/ml/model holds (default: a "
                        "serving.properties alone: the image's embedded model)")
    parser.add_argument("--role-arn", default="arn:aws:iam::111122223333:role/local",
                        help="any ARN: local mode assumes no role")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()
    model_dir = args.model_dir or Path(tempfile.mkdtemp(prefix="lmi-model-"))
    if args.model_dir is None:
        (model_dir / "serving.properties").write_text("engine=Python\n")
        model_dir.chmod(0o755)

    session = LocalSession()
    session.config = {"local": {"local_code": True}}
    model = Model(image_uri=args.image_uri, model_data=f"file://{model_dir.resolve()}",
                  role=args.role_arn, sagemaker_session=session, predictor_cls=Predictor)
    predictor = model.deploy(initial_instance_count=1, instance_type="local",
                             serializer=JSONSerializer(), deserializer=JSONDeserializer())
    try:
        body = {"inputs": PROMPT, "parameters": {"max_new_tokens": args.max_new_tokens}}
        # One string per print: local mode copies the container's log to this stdout from a thread.
        print(f"predict: {json.dumps(predictor.predict(body))}")
        runtime = boto3.client("sagemaker-runtime", endpoint_url="http://localhost:8080",
                               region_name=session.boto_region_name,
                               config=Config(signature_version=UNSIGNED))
        response = runtime.invoke_endpoint_with_response_stream(
            EndpointName=predictor.endpoint_name, ContentType="application/json",
            Body=json.dumps({**body, "stream": True}))
        lines = list(json_lines(LineIterator(response["Body"])))
        print(f"stream: {json.dumps(lines[-1])} ({len(lines)} lines)")
    finally:
        predictor.delete_endpoint()


if __name__ == "__main__":
    main()
