//! Record frames: the unit walship stores and ships.
//!
//! A record is encoded once, by the leader, into a [`Frame`]; the same bytes
//! are stored in the WAL, shipped inside segments and handed back to readers.
//! Every frame carries a crc32 (IEEE, `crc32fast`) over everything after the
//! checksum field, so a flipped bit or a torn write is detected wherever the
//! bytes travel.
//!
//! Layout (little-endian):
//!
//! ```text
//! offset  size  field
//!      0     4  body_len      bytes after the crc field (>= 28)
//!      4     4  crc32         over the body
//!      8     8  seqno         } body
//!     16     8  epoch         }
//!     24     8  timestamp_us  }
//!     32     4  key_len       }  low 28 bits; the high 4 are flags
//!     36    24  producer      }  only with flag PRODUCED: id, epoch, sequence
//!     36/60 *  key, then payload (the rest of the body)
//! ```
//!
//! The flags live in the top bits of `key_len` (a key is far below 2^28
//! bytes): frames written before producers existed have none set and keep
//! their meaning. The one flag, `PRODUCED` (bit 31), says the record was
//! written by a producer session and carries its [`ProducerStamp`]; the
//! WAL rebuilds its producer table (`crate::producers`) from these stamps.
//! Any other flag bit is refused.
//!
//! Invariant: a `Frame` value always holds exactly one complete frame whose
//! checksum and lengths were verified (or which this module produced).

use bytes::{BufMut, Bytes, BytesMut};

/// Bytes before the body: `body_len` and `crc32`.
const PREFIX_LEN: usize = 8;
/// Offset of the `key_len` field (and its flags).
const KEY_LEN_AT: usize = 32;
/// The low bits of the `key_len` field that hold the key's length.
const KEY_LEN_MASK: u32 = (1 << 28) - 1;
/// Flag: the record carries a producer stamp.
const FLAG_PRODUCED: u32 = 1 << 31;
/// Size of a producer stamp.
const STAMP_LEN: usize = 24;
/// Fixed part of the body: seqno, epoch, timestamp and key length.
const FIXED_BODY_LEN: usize = 28;
/// Size of a frame carrying an empty key and an empty payload.
pub const FRAME_OVERHEAD: usize = PREFIX_LEN + FIXED_BODY_LEN;
/// Largest body a frame may declare. It bounds what a decoder will believe
/// before allocating or slicing, far above any configured record limit.
pub const MAX_BODY_LEN: usize = 256 << 20;

/// Why bytes were refused as a frame or segment. Each variant says what was
/// wrong; none of them is retryable with the same bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    #[error("truncated: needed {needed} bytes, {available} available")]
    Truncated { needed: usize, available: usize },
    #[error("declared body length {0} is outside [{FIXED_BODY_LEN}, {MAX_BODY_LEN}]")]
    BadLength(usize),
    #[error("checksum mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    Checksum { stored: u32, computed: u32 },
    #[error("key length {key_len} exceeds the body's {available} bytes")]
    KeyLength { key_len: usize, available: usize },
    #[error("unknown flags {0:#x} in the key length field")]
    Flags(u32),
    #[error("{0} trailing bytes after the last frame")]
    Trailing(usize),
    #[error("bad segment header: {0}")]
    SegmentHeader(String),
    #[error("segment record {index} has seqno {found}, expected {expected}")]
    SeqnoGap { index: usize, expected: u64, found: u64 },
    #[error("segment declares {declared} records but holds {found}")]
    RecordCount { declared: u32, found: u32 },
}

/// The fields of a record, borrowed, for encoding.
#[derive(Debug, Clone, Copy)]
pub struct RecordFields<'a> {
    pub seqno: u64,
    pub epoch: u64,
    pub timestamp_us: u64,
    pub key: &'a [u8],
    pub payload: &'a [u8],
}

/// Who wrote a record in a producer session (see `crate::producers`): the
/// producer's id and epoch, and the record's sequence number within that
/// producer's writes to the shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ProducerStamp {
    pub id: u64,
    pub epoch: u64,
    pub sequence: u64,
}

/// One encoded, verified record.
#[derive(Clone, PartialEq, Eq)]
pub struct Frame(Bytes);

impl std::fmt::Debug for Frame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Frame")
            .field("seqno", &self.seqno())
            .field("epoch", &self.epoch())
            .field("len", &self.0.len())
            .finish()
    }
}

impl Frame {
    /// Encodes a record. Key and payload lengths are the caller's to bound
    /// (the node enforces its record limit before encoding).
    pub fn encode(fields: RecordFields<'_>) -> Frame {
        Self::encode_stamped(fields, None)
    }

    /// The same frame in an allocation of its own. A frame decoded from a
    /// received message is a slice of the receive buffer, and keeps all of
    /// it alive for as long as it is held.
    pub fn detached(&self) -> Frame {
        Frame(Bytes::copy_from_slice(&self.0))
    }

    /// Encodes a record, with the producer stamp when it has one.
    pub fn encode_stamped(fields: RecordFields<'_>, producer: Option<ProducerStamp>) -> Frame {
        let stamp = if producer.is_some() { STAMP_LEN } else { 0 };
        let mut buf = BytesMut::with_capacity(Self::encoded_len(fields.key.len(), fields.payload.len()) + stamp);
        Self::encode_into(fields, producer, &mut buf);
        Frame(buf.freeze())
    }

    /// Size of the frame for a key and payload of these lengths (without a
    /// producer stamp; [`Frame::STAMP_LEN`] more with one).
    pub fn encoded_len(key_len: usize, payload_len: usize) -> usize {
        FRAME_OVERHEAD + key_len + payload_len
    }

    /// Bytes a producer stamp adds to a frame.
    pub const STAMP_LEN: usize = STAMP_LEN;

    fn encode_into(fields: RecordFields<'_>, producer: Option<ProducerStamp>, buf: &mut BytesMut) {
        assert!(
            fields.key.len() <= KEY_LEN_MASK as usize,
            "keys are bounded far below 2^28 bytes by the node's limits"
        );
        let stamp = if producer.is_some() { STAMP_LEN } else { 0 };
        let body_len = FIXED_BODY_LEN + stamp + fields.key.len() + fields.payload.len();
        let start = buf.len();
        buf.put_u32_le(body_len as u32);
        buf.put_u32_le(0);
        buf.put_u64_le(fields.seqno);
        buf.put_u64_le(fields.epoch);
        buf.put_u64_le(fields.timestamp_us);
        let flags = if producer.is_some() { FLAG_PRODUCED } else { 0 };
        buf.put_u32_le(fields.key.len() as u32 | flags);
        if let Some(p) = producer {
            buf.put_u64_le(p.id);
            buf.put_u64_le(p.epoch);
            buf.put_u64_le(p.sequence);
        }
        buf.put_slice(fields.key);
        buf.put_slice(fields.payload);
        let crc = crc32fast::hash(&buf[start + PREFIX_LEN..]);
        buf[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
    }

    /// Parses exactly one frame; any byte beyond it is an error.
    pub fn parse(bytes: Bytes) -> Result<Frame, CodecError> {
        let (frame, rest) = Self::split_first(&bytes)?;
        if !rest.is_empty() {
            return Err(CodecError::Trailing(rest.len()));
        }
        Ok(frame)
    }

    /// The length of the frame `bytes` starts with, from its length prefix
    /// alone (bounds-checked, checksum not verified): how a reader skips
    /// frames it does not return.
    pub(crate) fn skip_len(bytes: &[u8]) -> Result<usize, CodecError> {
        if bytes.len() < PREFIX_LEN {
            return Err(CodecError::Truncated { needed: PREFIX_LEN, available: bytes.len() });
        }
        let body_len = u32::from_le_bytes(bytes[0..4].try_into().expect("4 bytes")) as usize;
        if !(FIXED_BODY_LEN..=MAX_BODY_LEN).contains(&body_len) {
            return Err(CodecError::BadLength(body_len));
        }
        let total = PREFIX_LEN + body_len;
        if bytes.len() < total {
            return Err(CodecError::Truncated { needed: total, available: bytes.len() });
        }
        Ok(total)
    }

    /// Splits the first frame off `bytes`, verifying it, and returns it with
    /// the remaining bytes. Zero-copy: both share `bytes`' buffer.
    pub fn split_first(bytes: &Bytes) -> Result<(Frame, Bytes), CodecError> {
        let total = Self::skip_len(bytes)?;
        let body_len = total - PREFIX_LEN;
        let stored = u32::from_le_bytes(bytes[4..8].try_into().expect("4 bytes"));
        let computed = crc32fast::hash(&bytes[PREFIX_LEN..total]);
        if stored != computed {
            return Err(CodecError::Checksum { stored, computed });
        }
        let field = u32::from_le_bytes(bytes[KEY_LEN_AT..KEY_LEN_AT + 4].try_into().expect("4 bytes"));
        let flags = field & !KEY_LEN_MASK;
        if flags & !FLAG_PRODUCED != 0 {
            return Err(CodecError::Flags(flags));
        }
        let key_len = (field & KEY_LEN_MASK) as usize;
        let stamp = if flags & FLAG_PRODUCED != 0 { STAMP_LEN } else { 0 };
        let available = body_len - FIXED_BODY_LEN;
        if stamp > available {
            return Err(CodecError::BadLength(body_len));
        }
        if key_len > available - stamp {
            return Err(CodecError::KeyLength { key_len, available: available - stamp });
        }
        Ok((Frame(bytes.slice(..total)), bytes.slice(total..)))
    }

    fn u64_at(&self, at: usize) -> u64 {
        u64::from_le_bytes(self.0[at..at + 8].try_into().expect("8 bytes"))
    }

    fn key_len_field(&self) -> u32 {
        u32::from_le_bytes(self.0[KEY_LEN_AT..KEY_LEN_AT + 4].try_into().expect("4 bytes"))
    }

    fn key_len(&self) -> usize {
        (self.key_len_field() & KEY_LEN_MASK) as usize
    }

    /// Where the key starts: after the producer stamp, if any.
    fn key_at(&self) -> usize {
        if self.key_len_field() & FLAG_PRODUCED != 0 { FRAME_OVERHEAD + STAMP_LEN } else { FRAME_OVERHEAD }
    }

    /// The producer session that wrote the record, if one did.
    pub fn producer(&self) -> Option<ProducerStamp> {
        (self.key_len_field() & FLAG_PRODUCED != 0).then(|| ProducerStamp {
            id: self.u64_at(FRAME_OVERHEAD),
            epoch: self.u64_at(FRAME_OVERHEAD + 8),
            sequence: self.u64_at(FRAME_OVERHEAD + 16),
        })
    }

    pub fn seqno(&self) -> u64 {
        self.u64_at(8)
    }

    pub fn epoch(&self) -> u64 {
        self.u64_at(16)
    }

    pub fn timestamp_us(&self) -> u64 {
        self.u64_at(24)
    }

    pub fn crc32(&self) -> u32 {
        u32::from_le_bytes(self.0[4..8].try_into().expect("4 bytes"))
    }

    pub fn key(&self) -> Bytes {
        let at = self.key_at();
        self.0.slice(at..at + self.key_len())
    }

    pub fn payload(&self) -> Bytes {
        self.0.slice(self.key_at() + self.key_len()..)
    }

    /// The encoded bytes, exactly as stored and shipped.
    pub fn as_bytes(&self) -> &Bytes {
        &self.0
    }

    pub fn into_bytes(self) -> Bytes {
        self.0
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn fields<'a>(seqno: u64, key: &'a [u8], payload: &'a [u8]) -> RecordFields<'a> {
        RecordFields { seqno, epoch: 7, timestamp_us: 1_700_000_000_000_000, key, payload }
    }

    proptest! {
        #[test]
        fn round_trip(seqno: u64, epoch: u64, ts: u64,
                      key in proptest::collection::vec(any::<u8>(), 0..64),
                      payload in proptest::collection::vec(any::<u8>(), 0..4096)) {
            let frame = Frame::encode(RecordFields { seqno, epoch, timestamp_us: ts, key: &key, payload: &payload });
            prop_assert_eq!(frame.len(), Frame::encoded_len(key.len(), payload.len()));
            let parsed = Frame::parse(frame.as_bytes().clone()).unwrap();
            prop_assert_eq!(parsed.seqno(), seqno);
            prop_assert_eq!(parsed.epoch(), epoch);
            prop_assert_eq!(parsed.timestamp_us(), ts);
            prop_assert_eq!(&parsed.key()[..], &key[..]);
            prop_assert_eq!(&parsed.payload()[..], &payload[..]);
            prop_assert_eq!(parsed, frame);
        }

        /// Any single flipped bit anywhere in a frame is refused.
        #[test]
        fn any_bit_flip_is_refused(payload in proptest::collection::vec(any::<u8>(), 0..512),
                                   bit in any::<prop::sample::Index>()) {
            let frame = Frame::encode(fields(42, b"k", &payload));
            let mut bytes = frame.as_bytes().to_vec();
            let bit = bit.index(bytes.len() * 8);
            bytes[bit / 8] ^= 1 << (bit % 8);
            prop_assert!(Frame::parse(Bytes::from(bytes)).is_err());
        }

        /// Every strict prefix of a frame is refused as truncated.
        #[test]
        fn truncation_is_refused(payload in proptest::collection::vec(any::<u8>(), 0..512),
                                 cut in any::<prop::sample::Index>()) {
            let frame = Frame::encode(fields(1, b"", &payload));
            let cut = cut.index(frame.len());
            let err = Frame::parse(frame.as_bytes().slice(..cut)).unwrap_err();
            let truncated = matches!(err, CodecError::Truncated { .. });
            prop_assert!(truncated, "{err:?}");
        }

        /// Arbitrary bytes never panic the decoder.
        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = Frame::parse(Bytes::from(bytes));
        }
    }

    proptest! {
        #[test]
        fn stamped_round_trip(seqno: u64, id: u64, epoch: u64, sequence: u64,
                              key in proptest::collection::vec(any::<u8>(), 0..64),
                              payload in proptest::collection::vec(any::<u8>(), 0..512)) {
            let stamp = ProducerStamp { id, epoch, sequence };
            let frame = Frame::encode_stamped(fields(seqno, &key, &payload), Some(stamp));
            prop_assert_eq!(frame.len(), Frame::encoded_len(key.len(), payload.len()) + Frame::STAMP_LEN);
            let parsed = Frame::parse(frame.as_bytes().clone()).unwrap();
            prop_assert_eq!(parsed.producer(), Some(stamp));
            prop_assert_eq!(parsed.seqno(), seqno);
            prop_assert_eq!(&parsed.key()[..], &key[..]);
            prop_assert_eq!(&parsed.payload()[..], &payload[..]);
        }
    }

    /// Rewrites the key-length field and the checksum.
    fn with_key_len_field(frame: &Frame, field: u32) -> Bytes {
        let mut bytes = frame.as_bytes().to_vec();
        bytes[KEY_LEN_AT..KEY_LEN_AT + 4].copy_from_slice(&field.to_le_bytes());
        let crc = crc32fast::hash(&bytes[PREFIX_LEN..]);
        bytes[4..8].copy_from_slice(&crc.to_le_bytes());
        Bytes::from(bytes)
    }

    #[test]
    fn an_unstamped_frame_has_no_producer() {
        assert_eq!(Frame::encode(fields(1, b"k", b"v")).producer(), None);
    }

    #[test]
    fn unknown_flags_are_refused() {
        let frame = Frame::encode(fields(1, b"k", b"v"));
        assert_eq!(Frame::parse(with_key_len_field(&frame, 1 | (1 << 29))), Err(CodecError::Flags(1 << 29)));
    }

    #[test]
    fn a_stamp_flag_without_room_for_the_stamp_is_refused() {
        let frame = Frame::encode(fields(1, b"", b"short"));
        let body_len = frame.len() - PREFIX_LEN;
        assert_eq!(Frame::parse(with_key_len_field(&frame, FLAG_PRODUCED)), Err(CodecError::BadLength(body_len)));
    }

    #[test]
    fn trailing_bytes_are_refused() {
        let frame = Frame::encode(fields(1, b"", b"x"));
        let mut bytes = frame.as_bytes().to_vec();
        bytes.push(0);
        assert_eq!(Frame::parse(Bytes::from(bytes)), Err(CodecError::Trailing(1)));
    }

    #[test]
    fn absurd_length_is_refused_before_allocating() {
        let mut bytes = vec![0u8; 64];
        bytes[0..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(Frame::parse(Bytes::from(bytes)), Err(CodecError::BadLength(u32::MAX as usize)));
    }

    #[test]
    fn key_length_past_body_is_refused() {
        let frame = Frame::encode(fields(1, b"ab", b"cd"));
        let mut bytes = frame.as_bytes().to_vec();
        bytes[32..36].copy_from_slice(&100u32.to_le_bytes());
        let crc = crc32fast::hash(&bytes[PREFIX_LEN..]);
        bytes[4..8].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(Frame::parse(Bytes::from(bytes)), Err(CodecError::KeyLength { key_len: 100, available: 4 }));
    }
}
