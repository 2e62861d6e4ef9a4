//! A prost codec whose decoder reports malformed messages as
//! `INVALID_ARGUMENT`.
//!
//! tonic's stock codec maps a protobuf decode error to `INTERNAL`, which is
//! what the gRPC status guide suggests but misleads operators and clients:
//! the server is healthy, the request was not. Encoding is unchanged.

use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};

use prost::Message;
use tonic::Status;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic_prost::{ProstDecoder, ProstEncoder};

/// Messages this process received that did not decode.
static UNDECODABLE: AtomicU64 = AtomicU64::new(0);

/// How many protobuf messages this process has received that did not
/// decode: requests refused with `INVALID_ARGUMENT` before reaching a
/// service, and answers from a peer that could not be read (every walship
/// server and client uses [`StrictCodec`]). Exported as
/// `walship_grpc_undecodable_messages_total`.
pub fn undecodable_messages() -> u64 {
    UNDECODABLE.load(Ordering::Relaxed)
}

/// Codec for every walship service (set in `build.rs` via `codec_path`).
#[derive(Debug, Clone)]
pub struct StrictCodec<T, U> {
    _pd: PhantomData<(T, U)>,
}

impl<T, U> Default for StrictCodec<T, U> {
    fn default() -> Self {
        Self { _pd: PhantomData }
    }
}

impl<T, U> Codec for StrictCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = StrictDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::new(BufferSettings::default())
    }

    fn decoder(&mut self) -> Self::Decoder {
        StrictDecoder { inner: ProstDecoder::new(BufferSettings::default()) }
    }
}

/// Decoder that maps prost decode failures to `INVALID_ARGUMENT`.
#[derive(Debug)]
pub struct StrictDecoder<U> {
    inner: ProstDecoder<U>,
}

impl<U: Message + Default> Decoder for StrictDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        self.inner.decode(buf).map_err(|status| {
            UNDECODABLE.fetch_add(1, Ordering::Relaxed);
            Status::invalid_argument(format!("malformed protobuf message: {}", status.message()))
        })
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.inner.buffer_settings()
    }
}
