//! An Arrow IPC file written by walship's exporter
//! (`walship_dataplane::arrow_export::IpcFileWriter`, what
//! `walship export --out FILE.arrow` writes) read by pyarrow, as a user
//! would read it: every row and field comes back as written, the schema is
//! the documented one (UInt64 seqno and epoch, a UTC microsecond timestamp,
//! a nullable binary key that is null for an empty key, a binary payload),
//! and a file whose export was interrupted is refused. pyarrow comes from
//! PyPI into `.walship/tools/venv` (`install_pyarrow` in ops/install.sh, run
//! by ops/test.sh).

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use walship_dataplane::arrow_export::{IpcFileWriter, ipc_stream};
use walship_wal::{Frame, RecordFields};

fn python() -> PathBuf {
    match std::env::var_os("WALSHIP_PYTHON") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".walship/tools/venv/bin/python"),
    }
}

/// Reads `path` with pyarrow and prints the schema and every row as JSON:
/// binary values as lists of byte values, the timestamp as its integer
/// microseconds and its type.
const READER: &str = r#"
import json, sys
import pyarrow as pa
with pa.memory_map(sys.argv[1], "r") as source:
    reader = pa.ipc.open_file(source)
    table = reader.read_all()
    batches = reader.num_record_batches
ts = table.column("timestamp_us")
rows = []
for i in range(table.num_rows):
    row = {}
    for name in ("seqno", "epoch", "key", "payload"):
        v = table.column(name)[i].as_py()
        row[name] = list(v) if isinstance(v, bytes) else v
    row["timestamp_us"] = ts.cast(pa.int64())[i].as_py()
    rows.append(row)
schema = [[f.name, str(f.type), f.nullable] for f in table.schema]
print(json.dumps({"schema": schema, "batches": batches, "rows": rows}))
"#;

fn read_with_pyarrow(path: &Path) -> Result<Value, String> {
    let python = python();
    assert!(
        python.is_file(),
        "python with pyarrow not found at {}: run ops/test.sh (it installs it)",
        python.display()
    );
    let output = Command::new(&python).arg("-c").arg(READER).arg(path).output().unwrap();
    if !output.status.success() {
        return Err(String::from_utf8_lossy(&output.stderr).into_owned());
    }
    Ok(serde_json::from_slice(&output.stdout).unwrap())
}

fn frame(seqno: u64, epoch: u64, timestamp_us: u64, key: &[u8], payload: &[u8]) -> Frame {
    Frame::encode(RecordFields { seqno, epoch, timestamp_us, key, payload })
}

/// Records covering an empty key (null), an empty payload, zero bytes and
/// every byte value, and extreme seqnos, epochs and timestamps.
fn records() -> Vec<Frame> {
    let every_byte: Vec<u8> = (0..=255).collect();
    let mut frames = vec![
        frame(1, 1, 1_700_000_000_000_001, b"user-1", b"hello"),
        frame(2, 1, 1_700_000_000_000_002, b"", b"record without a key"),
        frame(3, 2, 1_700_000_000_000_003, b"\0key\0", b"\0\0zeros\0inside\0"),
        frame(4, 2, 0, b"k", b""),
        frame(5, 3, 1_700_000_000_000_005, &every_byte, &every_byte),
    ];
    frames.extend((6..=1000).map(|s| frame(s, 3, 1_700_000_000_000_000 + s, b"", format!("p{s}").as_bytes())));
    frames.push(frame(u64::MAX, u64::MAX, i64::MAX as u64, b"last", b"\xff"));
    frames
}

fn expected_row(f: &Frame) -> Value {
    let key = f.key();
    serde_json::json!({
        "seqno": f.seqno(),
        "epoch": f.epoch(),
        "timestamp_us": f.timestamp_us(),
        "key": if key.is_empty() { Value::Null } else { serde_json::json!(key.to_vec()) },
        "payload": f.payload().to_vec(),
    })
}

#[test]
fn pyarrow_reads_every_field_of_an_export() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("export.arrow");
    let frames = records();
    let (first, rest) = frames.split_at(3);
    let mut writer = IpcFileWriter::create(&path).unwrap();
    // As the coordinator does it: one worker's ResultBatch payload decoded
    // and appended, then another.
    writer.write_ipc_stream(&ipc_stream(first).unwrap()).unwrap();
    writer.write_ipc_stream(&ipc_stream(rest).unwrap()).unwrap();
    assert_eq!(writer.finish().unwrap(), frames.len() as u64);

    let read = read_with_pyarrow(&path).unwrap_or_else(|e| panic!("pyarrow refused the export:\n{e}"));
    assert_eq!(
        read["schema"],
        serde_json::json!([
            ["seqno", "uint64", false],
            ["epoch", "uint64", false],
            ["timestamp_us", "timestamp[us, tz=UTC]", false],
            ["key", "binary", true],
            ["payload", "binary", false],
        ])
    );
    assert_eq!(read["batches"], 2);
    let rows = read["rows"].as_array().unwrap();
    assert_eq!(rows.len(), frames.len());
    for (row, f) in rows.iter().zip(&frames) {
        assert_eq!(row, &expected_row(f), "seqno {}", f.seqno());
    }
    assert_eq!(rows[1]["key"], Value::Null, "an empty key reads as null");
    assert_eq!(rows[3]["payload"], serde_json::json!([]), "an empty payload is empty, not null");
}

#[test]
fn pyarrow_refuses_an_unfinished_export() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("interrupted.arrow");
    let mut writer = IpcFileWriter::create(&path).unwrap();
    writer.write_frames(&records()).unwrap();
    drop(writer); // interrupted: never finished
    let err = read_with_pyarrow(&path).expect_err("pyarrow read a file without a footer");
    assert!(err.contains("ArrowInvalid"), "{err}");
}
