//! A prost codec whose decoder reports malformed messages as
//! `INVALID_ARGUMENT`.
//!
//! tonic's stock codec maps a protobuf decode error to `INTERNAL`, which is
//! what the gRPC status guide suggests but misleads operators and clients:
//! the server is healthy, the request was not. Encoding is unchanged.

use std::any::TypeId;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

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

/// Records one decoded append may carry (`usize::MAX` until a server sets
/// it): see [`limit_append_records`].
static MAX_APPEND_RECORDS: AtomicUsize = AtomicUsize::new(usize::MAX);

/// Refuses, before decoding it, an `AppendRequest` (alone, or in an
/// `AppendStreamRequest`) carrying more than `max` records, with
/// `INVALID_ARGUMENT`. An empty record costs 2 bytes on the wire and about
/// 64 once decoded, so a message within the size cap could otherwise make
/// a server allocate gigabytes before the service's own count check runs.
/// Process-wide: a node sets it once from `limits.max_batch_records`.
pub fn limit_append_records(max: usize) {
    MAX_APPEND_RECORDS.store(max, Ordering::Relaxed);
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

impl<U: Message + Default + 'static> Decoder for StrictDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        check_append_records::<U>(prost::bytes::Buf::chunk(buf))?;
        self.inner.decode(buf).map_err(|status| {
            UNDECODABLE.fetch_add(1, Ordering::Relaxed);
            Status::invalid_argument(format!("malformed protobuf message: {}", status.message()))
        })
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.inner.buffer_settings()
    }
}

/// The [`limit_append_records`] check of an encoded message of type `U`
/// (only appends are looked at). A message that does not parse is left to
/// prost, which refuses it.
fn check_append_records<U: 'static>(encoded: &[u8]) -> Result<(), Status> {
    let max = MAX_APPEND_RECORDS.load(Ordering::Relaxed);
    if max == usize::MAX {
        return Ok(());
    }
    // Both messages keep the field that matters in number 2: the records
    // of an `AppendRequest`, the append of an `AppendStreamRequest` (whose
    // occurrences protobuf merges, records and all).
    let records = if TypeId::of::<U>() == TypeId::of::<crate::log::AppendRequest>() {
        count_field(encoded, 2, &mut |_| 1)
    } else if TypeId::of::<U>() == TypeId::of::<crate::log::AppendStreamRequest>() {
        count_field(encoded, 2, &mut |append| count_field(append, 2, &mut |_| 1).unwrap_or(0))
    } else {
        return Ok(());
    };
    match records {
        Some(n) if n > max => {
            UNDECODABLE.fetch_add(1, Ordering::Relaxed);
            Err(Status::invalid_argument(format!(
                "an append carries {n} records; the limit is {max} (max_batch_records); nothing was written"
            )))
        }
        _ => Ok(()),
    }
}

/// Sums `count` over the length-delimited occurrences of field `field` at
/// the top level of `message` (saturating), or `None` where the bytes are
/// not a well-formed message.
fn count_field(mut message: &[u8], field: u64, count: &mut dyn FnMut(&[u8]) -> usize) -> Option<usize> {
    let mut total = 0usize;
    while !message.is_empty() {
        let key = prost::encoding::decode_varint(&mut message).ok()?;
        let skip = match key & 7 {
            0 => {
                prost::encoding::decode_varint(&mut message).ok()?;
                0
            }
            1 => 8,
            5 => 4,
            2 => {
                let len = usize::try_from(prost::encoding::decode_varint(&mut message).ok()?).ok()?;
                let body = message.get(..len)?;
                if key >> 3 == field {
                    total = total.saturating_add(count(body));
                }
                len
            }
            _ => return None,
        };
        message = message.get(skip..)?;
    }
    Some(total)
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;
    use crate::log::{AppendRecord, AppendRequest, AppendStreamRequest};

    fn request(records: usize) -> AppendRequest {
        AppendRequest { shard_id: 1, records: vec![AppendRecord::default(); records], ..Default::default() }
    }

    #[test]
    fn counts_the_records_of_an_append_alone_and_in_a_stream_request() {
        let append = request(5).encode_to_vec();
        assert_eq!(count_field(&append, 2, &mut |_| 1), Some(5));
        let streamed = AppendStreamRequest { request_id: 9, append: Some(request(7)) }.encode_to_vec();
        assert_eq!(count_field(&streamed, 2, &mut |a| count_field(a, 2, &mut |_| 1).unwrap_or(0)), Some(7));
        // Two occurrences of the append field merge: their records add up.
        let mut twice = streamed.clone();
        twice.extend_from_slice(&AppendStreamRequest { request_id: 0, append: Some(request(4)) }.encode_to_vec());
        assert_eq!(count_field(&twice, 2, &mut |a| count_field(a, 2, &mut |_| 1).unwrap_or(0)), Some(11));
        assert_eq!(AppendStreamRequest::decode(twice.as_slice()).unwrap().append.unwrap().records.len(), 11);
    }

    #[test]
    fn malformed_bytes_are_left_to_prost() {
        assert_eq!(count_field(&[0x12, 0x05, 0x00], 2, &mut |_| 1), None, "a length past the end");
        assert_eq!(count_field(&[0x13], 2, &mut |_| 1), None, "a group");
        assert_eq!(count_field(&[0xff; 11], 2, &mut |_| 1), None, "a varint too long");
    }

    #[test]
    fn an_append_over_the_limit_is_refused_before_decoding() {
        limit_append_records(3);
        let refused = check_append_records::<AppendRequest>(&request(4).encode_to_vec()).unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument);
        assert!(refused.message().contains("4 records; the limit is 3"), "{}", refused.message());
        let streamed = AppendStreamRequest { request_id: 1, append: Some(request(4)) }.encode_to_vec();
        assert!(check_append_records::<AppendStreamRequest>(&streamed).is_err());
        assert!(check_append_records::<AppendRequest>(&request(3).encode_to_vec()).is_ok());
        // Other messages are not looked at.
        assert!(check_append_records::<crate::log::ReadRequest>(&request(4).encode_to_vec()).is_ok());
        limit_append_records(usize::MAX);
    }
}
