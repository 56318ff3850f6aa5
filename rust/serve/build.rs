//! Generates the Open Inference Protocol v2 gRPC messages (prost) and the
//! `inference.GRPCInferenceService` server (tonic) from the proto vendored
//! with the Python package, compiled in-process by protox: no `protoc` needed.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir =
        PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../../python/ferrobatch/grpc");
    let proto = "grpc_predict_v2.proto";
    println!("cargo:rerun-if-changed={}", dir.join(proto).display());
    let descriptors = protox::compile([proto], [&dir])?;
    tonic_prost_build::configure()
        .build_client(false)
        .build_transport(false)
        // `bytes` fields as `Bytes`: raw tensors are slices of the received
        // message, kept (not copied) until their request resolves.
        .bytes(".")
        // prost's codec, its decoding failures INVALID_ARGUMENT (the client's).
        .codec_path("crate::grpc::ClientCodec")
        .compile_fds(descriptors)?;
    Ok(())
}
