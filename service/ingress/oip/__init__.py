"""Open Inference Protocol v2 (KServe / Triton HTTP/REST) for the model `attention`.

Parts: `schemas` (the protocol's pydantic models and bounds), `codec` (request body ->
checked tensors, output tensor -> reply; pure, no HTTP framework state), `inference` (one
request's deadline and computation: a stateless inference or a sequence's append), `routes`
(the FastAPI router, on the ingress and on the direct data plane). The same protocol over
gRPC (service.ingress.oip_grpc) goes through `codec.check_inputs` and `inference` too.

Routes: GET /v2, /v2/health/live, /v2/health/ready, /v2/models/attention[/versions/1],
.../ready, and POST .../infer with JSON tensors or the binary tensor data extension:
the body is the JSON inference header (`Inference-Header-Content-Length` bytes) followed
by the raw little-endian row-major bytes of every input whose parameters hold
`binary_data_size`, in input order. Outputs asked for with `binary_data: true` (or all of
them when the request has `binary_data_output: true`) come back the same way.

Tensors: one input `hidden_states` ([batch, seq, E] or [seq, E]; FP32, FP16, BF16 or FP64,
computed in the app's compute_dtype), an optional second input `attention_mask` ([batch, seq]
or [seq]; BOOL, UINT8, INT32 or INT64; 1 = token, 0 = padding), request parameter `causal`
(boolean), one output `output` of the same shape, in the input's datatype unless
the `output_dtype` query parameter asks for another. Errors are JSON `{"error", "code"}`
(OIP clients read `error`). Shapes and limits are checked before any tensor data is
decoded, and long before any compute.

Bounds: the body by max_body_bytes; a JSON-only body (no Inference-Header-Content-Length),
and the JSON header of a binary one, by max_json_bytes, counted after decompression (gzip /
deflate are inflated only up to that cap, in the DecodePool: never on the event loop).
"""
