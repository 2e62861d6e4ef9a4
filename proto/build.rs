//! Compiles walship's `.proto` contracts with tonic + prost. protoc comes from
//! `protoc-bin-vendored` unless `PROTOC` is set, so a fresh machine needs no
//! system protoc. A file descriptor set is written beside the generated code
//! for gRPC server reflection.

use std::path::PathBuf;

const PROTOS: &[&str] = &[
    "proto/tidal/replication/v1/wal_shipping.proto",
    "proto/dataplane/v1/dataplane.proto",
    "proto/dataplane/v1/peer.proto",
    "proto/walship/v1/log.proto",
    "proto/walship/v1/control.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os("PROTOC").is_none() {
        // SAFETY: build scripts are single-threaded; nothing else reads the
        // environment concurrently.
        unsafe { std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?) };
    }
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        .file_descriptor_set_path(out_dir.join("walship_descriptor.bin"))
        // `DataPlane.Connect` would collide with the generated `connect`
        // constructor; clients are built from a `Channel` instead.
        .build_transport(false)
        .bytes(".")
        // Ordered maps encode the same way every time: a node keeps only a
        // digest of each shard's last heartbeat report and compares the
        // next one's encoding with it.
        .btree_map(".")
        .codec_path("crate::codec::StrictCodec")
        .compile_protos(PROTOS, &["proto"])?;
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={proto}");
    }
    Ok(())
}
