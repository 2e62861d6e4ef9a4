//! Segments: a contiguous run of one shard's records, encoded once by the
//! leader and shipped byte-identical to every follower
//! (`ShipSegmentRequest.payload`).
//!
//! Layout (little-endian): a 32-byte header, then the record frames back to
//! back, exactly as stored in the WAL.
//!
//! ```text
//! offset  size  field
//!      0     4  magic "WSEG"
//!      4     2  version (1)
//!      6     2  reserved, zero
//!      8     4  shard_id
//!     12     8  first_seqno
//!     20     4  record_count (>= 1)
//!     24     4  frames_len    bytes of frames that follow
//!     28     4  header_crc    crc32 over bytes 0..28
//! ```
//!
//! Decoding verifies the header checksum, every frame's checksum, that the
//! frames' seqnos run contiguously from `first_seqno`, and that the counts and
//! lengths add up exactly. A segment that fails any check is refused whole:
//! nothing from it may be applied.

use bytes::{BufMut, Bytes, BytesMut};

use crate::record::{CodecError, Frame};

const MAGIC: &[u8; 4] = b"WSEG";
const VERSION: u16 = 1;
/// Size of the segment header.
pub const SEGMENT_HEADER_LEN: usize = 32;

/// A verified segment: its shard, its seqno range and its frames.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    shard_id: u32,
    frames: Vec<Frame>,
    encoded: Bytes,
}

/// A segment's verified header (see the layout above).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentHeader {
    pub shard_id: u32,
    pub first_seqno: u64,
    /// `>= 1`.
    pub record_count: u32,
    /// Bytes of frames after the header; the encoding is exactly
    /// `SEGMENT_HEADER_LEN + frames_len` bytes.
    pub frames_len: usize,
}

impl SegmentHeader {
    /// Parses and verifies the header of an encoded segment: magic,
    /// checksum, version, a non-zero record count, and a total length that
    /// matches the encoding's exactly. The frames are not read.
    pub fn parse(bytes: &[u8]) -> Result<SegmentHeader, CodecError> {
        if bytes.len() < SEGMENT_HEADER_LEN {
            return Err(CodecError::Truncated { needed: SEGMENT_HEADER_LEN, available: bytes.len() });
        }
        let header = &bytes[..SEGMENT_HEADER_LEN];
        if &header[0..4] != MAGIC {
            return Err(CodecError::SegmentHeader("bad magic".into()));
        }
        let stored = u32::from_le_bytes(header[28..32].try_into().expect("4 bytes"));
        let computed = crc32fast::hash(&header[..28]);
        if stored != computed {
            return Err(CodecError::Checksum { stored, computed });
        }
        let version = u16::from_le_bytes(header[4..6].try_into().expect("2 bytes"));
        if version != VERSION {
            return Err(CodecError::SegmentHeader(format!("unsupported version {version}")));
        }
        let shard_id = u32::from_le_bytes(header[8..12].try_into().expect("4 bytes"));
        let first_seqno = u64::from_le_bytes(header[12..20].try_into().expect("8 bytes"));
        let record_count = u32::from_le_bytes(header[20..24].try_into().expect("4 bytes"));
        let frames_len = u32::from_le_bytes(header[24..28].try_into().expect("4 bytes")) as usize;
        if record_count == 0 {
            return Err(CodecError::SegmentHeader("zero records".into()));
        }
        if first_seqno.checked_add(u64::from(record_count)).is_none() {
            return Err(CodecError::SegmentHeader("seqno range overflows".into()));
        }
        let body = bytes.len() - SEGMENT_HEADER_LEN;
        if body < frames_len {
            return Err(CodecError::Truncated { needed: SEGMENT_HEADER_LEN + frames_len, available: bytes.len() });
        }
        if body > frames_len {
            return Err(CodecError::Trailing(body - frames_len));
        }
        Ok(SegmentHeader { shard_id, first_seqno, record_count, frames_len })
    }

    pub fn last_seqno(&self) -> u64 {
        self.first_seqno + u64::from(self.record_count) - 1
    }

    /// The header's 32 bytes, checksum included.
    pub fn encode(&self) -> [u8; SEGMENT_HEADER_LEN] {
        let mut buf = BytesMut::with_capacity(SEGMENT_HEADER_LEN);
        buf.put_slice(MAGIC);
        buf.put_u16_le(VERSION);
        buf.put_u16_le(0);
        buf.put_u32_le(self.shard_id);
        buf.put_u64_le(self.first_seqno);
        buf.put_u32_le(self.record_count);
        buf.put_u32_le(self.frames_len as u32);
        let crc = crc32fast::hash(&buf[..28]);
        buf.put_u32_le(crc);
        buf[..].try_into().expect("32 bytes")
    }
}

impl Segment {
    /// Encodes frames (which must be non-empty and contiguous) into a segment.
    pub fn encode(shard_id: u32, frames: Vec<Frame>) -> Result<Segment, CodecError> {
        let first = frames
            .first()
            .ok_or_else(|| CodecError::SegmentHeader("a segment holds at least one record".into()))?
            .seqno();
        for (index, frame) in frames.iter().enumerate() {
            let expected = first + index as u64;
            if frame.seqno() != expected {
                return Err(CodecError::SeqnoGap { index, expected, found: frame.seqno() });
            }
        }
        let frames_len: usize = frames.iter().map(Frame::len).sum();
        let mut buf = BytesMut::with_capacity(SEGMENT_HEADER_LEN + frames_len);
        let header = SegmentHeader { shard_id, first_seqno: first, record_count: frames.len() as u32, frames_len };
        buf.put_slice(&header.encode());
        for frame in &frames {
            buf.put_slice(frame.as_bytes());
        }
        Ok(Segment { shard_id, frames, encoded: buf.freeze() })
    }

    /// Decodes and verifies a segment. Zero-copy: the frames share `bytes`.
    pub fn decode(bytes: Bytes) -> Result<Segment, CodecError> {
        let header = SegmentHeader::parse(&bytes)?;
        let mut rest = bytes.slice(SEGMENT_HEADER_LEN..);
        let mut frames = Vec::with_capacity(header.record_count.min(1 << 16) as usize);
        while !rest.is_empty() {
            let (frame, tail) = Frame::split_first(&rest)?;
            let index = frames.len();
            // More frames than declared: refused here, before a seqno past
            // the declared range is even computed (it may not exist).
            if index == header.record_count as usize {
                return Err(CodecError::RecordCount { declared: header.record_count, found: index as u32 + 1 });
            }
            let expected = header.first_seqno + index as u64;
            if frame.seqno() != expected {
                return Err(CodecError::SeqnoGap { index, expected, found: frame.seqno() });
            }
            frames.push(frame);
            rest = tail;
        }
        if frames.len() != header.record_count as usize {
            return Err(CodecError::RecordCount { declared: header.record_count, found: frames.len() as u32 });
        }
        Ok(Segment { shard_id: header.shard_id, frames, encoded: bytes })
    }

    /// The frames `[from, to]` of an encoded segment, stopping before their
    /// total size passes `max_bytes` but returning at least one when any is
    /// in range: how a stored segment is read without decoding all of it.
    /// The header and every returned frame are verified (checksum and
    /// seqno); frames before `from` are skipped by their length prefixes,
    /// whose bounds are checked. Zero-copy: the frames share `bytes`.
    pub fn frames_in(
        bytes: &Bytes,
        from: u64,
        to: u64,
        max_bytes: usize,
    ) -> Result<(SegmentHeader, Vec<Frame>), CodecError> {
        let header = SegmentHeader::parse(bytes)?;
        let mut at = SEGMENT_HEADER_LEN;
        let mut seqno = header.first_seqno;
        let mut frames = Vec::new();
        let mut size = 0usize;
        while seqno <= to.min(header.last_seqno()) {
            let rest = bytes.slice(at..);
            if seqno < from {
                at += Frame::skip_len(&rest)?;
                seqno += 1;
                continue;
            }
            let (frame, _) = Frame::split_first(&rest)?;
            if frame.seqno() != seqno {
                let index = (seqno - header.first_seqno) as usize;
                return Err(CodecError::SeqnoGap { index, expected: seqno, found: frame.seqno() });
            }
            size += frame.len();
            if size > max_bytes && !frames.is_empty() {
                break;
            }
            at += frame.len();
            frames.push(frame);
            seqno += 1;
        }
        Ok((header, frames))
    }

    pub fn shard_id(&self) -> u32 {
        self.shard_id
    }

    pub fn first_seqno(&self) -> u64 {
        self.frames[0].seqno()
    }

    pub fn last_seqno(&self) -> u64 {
        self.frames[self.frames.len() - 1].seqno()
    }

    pub fn frames(&self) -> &[Frame] {
        &self.frames
    }

    pub fn into_frames(self) -> Vec<Frame> {
        self.frames
    }

    /// The encoded bytes, byte-identical on every replica.
    pub fn encoded(&self) -> &Bytes {
        &self.encoded
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::RecordFields;
    use proptest::prelude::*;

    fn frames(first: u64, payloads: &[Vec<u8>]) -> Vec<Frame> {
        payloads
            .iter()
            .enumerate()
            .map(|(i, p)| {
                Frame::encode(RecordFields { seqno: first + i as u64, epoch: 3, timestamp_us: 9, key: b"", payload: p })
            })
            .collect()
    }

    #[test]
    fn more_frames_than_declared_are_refused_even_at_the_end_of_the_seqnos() {
        // Declares one record at u64::MAX - 1 but carries three: the third
        // would be past u64::MAX.
        let body = frames(u64::MAX - 1, &[b"a".to_vec(), b"b".to_vec()]);
        let extra = Frame::encode(RecordFields { seqno: 7, epoch: 3, timestamp_us: 9, key: b"", payload: b"c" });
        let body: Vec<u8> = body.iter().chain([&extra]).flat_map(|f| f.as_bytes().to_vec()).collect();
        let header = SegmentHeader { shard_id: 1, first_seqno: u64::MAX - 1, record_count: 1, frames_len: body.len() };
        let bytes = Bytes::from([&header.encode()[..], &body].concat());
        match Segment::decode(bytes) {
            Err(CodecError::RecordCount { declared: 1, found: 2 }) => {}
            other => panic!("{other:?}"),
        }
    }

    proptest! {
        #[test]
        fn round_trip(shard: u32, first in 1u64..u64::MAX / 2,
                      payloads in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..300), 1..20)) {
            let seg = Segment::encode(shard, frames(first, &payloads)).unwrap();
            let decoded = Segment::decode(seg.encoded().clone()).unwrap();
            prop_assert_eq!(decoded.shard_id(), shard);
            prop_assert_eq!(decoded.first_seqno(), first);
            prop_assert_eq!(decoded.last_seqno(), first + payloads.len() as u64 - 1);
            prop_assert_eq!(decoded.frames(), seg.frames());
            prop_assert_eq!(decoded.encoded(), seg.encoded());
        }

        /// Any flipped bit in a segment (header or any frame) is refused.
        #[test]
        fn any_bit_flip_is_refused(payloads in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..100), 1..8),
                                   bit in any::<prop::sample::Index>()) {
            let seg = Segment::encode(1, frames(10, &payloads)).unwrap();
            let mut bytes = seg.encoded().to_vec();
            let bit = bit.index(bytes.len() * 8);
            bytes[bit / 8] ^= 1 << (bit % 8);
            prop_assert!(Segment::decode(Bytes::from(bytes)).is_err());
        }

        /// Every strict prefix of a segment is refused.
        #[test]
        fn truncation_is_refused(payloads in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..100), 1..8),
                                 cut in any::<prop::sample::Index>()) {
            let seg = Segment::encode(1, frames(10, &payloads)).unwrap();
            let cut = cut.index(seg.encoded().len());
            prop_assert!(Segment::decode(seg.encoded().slice(..cut)).is_err());
        }

        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = Segment::decode(Bytes::from(bytes));
        }

        /// `frames_in` returns exactly the decoded frames in range, cut by
        /// size as the store's reads are (at least one frame).
        #[test]
        fn frames_in_matches_decode(payloads in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..200), 1..20),
                                    a in 0u64..25, b in 0u64..25, max_bytes in 0usize..2000) {
            let seg = Segment::encode(4, frames(100, &payloads)).unwrap();
            let (from, to) = (100 + a.min(b), 100 + a.max(b));
            let (header, got) = Segment::frames_in(seg.encoded(), from, to, max_bytes).unwrap();
            prop_assert_eq!(header.first_seqno, 100);
            prop_assert_eq!(header.last_seqno(), seg.last_seqno());
            let mut want = Vec::new();
            let mut size = 0;
            for frame in seg.frames().iter().filter(|f| (from..=to).contains(&f.seqno())) {
                size += frame.len();
                if size > max_bytes && !want.is_empty() {
                    break;
                }
                want.push(frame.clone());
            }
            prop_assert_eq!(got, want);
        }

        /// A flipped bit in the header, or in a frame `frames_in` returns,
        /// is refused; garbage never panics it.
        #[test]
        fn frames_in_refuses_damage_it_reads(payloads in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 1..100), 1..8),
                                             bit in any::<prop::sample::Index>()) {
            let seg = Segment::encode(1, frames(10, &payloads)).unwrap();
            let mut bytes = seg.encoded().to_vec();
            let bit = bit.index(bytes.len() * 8);
            bytes[bit / 8] ^= 1 << (bit % 8);
            prop_assert!(Segment::frames_in(&Bytes::from(bytes), 10, u64::MAX, usize::MAX).is_err());
        }

        #[test]
        fn frames_in_never_panics_on_garbage(bytes in proptest::collection::vec(any::<u8>(), 0..512), from in 0u64..50) {
            let _ = Segment::frames_in(&Bytes::from(bytes), from, from + 10, 1000);
        }
    }

    #[test]
    fn encode_refuses_gaps_and_empty() {
        let mut fs = frames(1, &[vec![1], vec![2], vec![3]]);
        fs.remove(1);
        assert_eq!(Segment::encode(1, fs), Err(CodecError::SeqnoGap { index: 1, expected: 2, found: 3 }));
        assert!(Segment::encode(1, vec![]).is_err());
    }

    #[test]
    fn decode_refuses_well_formed_frames_out_of_order() {
        // Two valid frames whose seqnos do not match the header: each frame's
        // checksum passes, the segment must still be refused.
        let a = frames(5, &[vec![1]]);
        let b = frames(7, &[vec![2]]);
        let good = Segment::encode(1, frames(5, &[vec![1], vec![2]])).unwrap();
        let mut bytes = good.encoded()[..SEGMENT_HEADER_LEN].to_vec();
        bytes.extend_from_slice(a[0].as_bytes());
        bytes.extend_from_slice(b[0].as_bytes());
        assert_eq!(Segment::decode(Bytes::from(bytes)), Err(CodecError::SeqnoGap { index: 1, expected: 6, found: 7 }));
    }
}
