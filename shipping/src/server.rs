//! The `tidal.replication.v1.WalShipping` service of a node: the follower
//! side of `ShipSegment`, the leader side of `StreamSegments`, and the
//! `Heartbeat` receiver. Every refusal is a clear status, counted in
//! `walship_ship_refused_total{reason}`, and applies nothing:
//!
//! | condition | status |
//! | --- | --- |
//! | shard not hosted here | `NOT_FOUND` |
//! | corrupt segment (crc, truncation), envelope not matching the segment, `from_seqno` 0, unknown heartbeat node | `INVALID_ARGUMENT` |
//! | older epoch than seen (metadata `walship-epoch`), sent to the leader, from a node that is not the leader | `FAILED_PRECONDITION` |
//! | gap (metadata `walship-applied-seqno`), catch-up from a compacted seqno (needs re-seed) | `OUT_OF_RANGE` |
//! | message over the size limit | `OUT_OF_RANGE` (tonic's frame check) |

use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use walship_proto::replication::wal_shipping_server::WalShipping;
use walship_proto::replication::{
    HeartbeatRequest, HeartbeatResponse, ShipSegmentRequest, ShipSegmentResponse, StreamRequest,
};

use crate::replica::{ReplicationNode, Source};

/// The WalShipping service over a node's replication runtime.
#[derive(Clone)]
pub struct WalShippingService {
    node: Arc<ReplicationNode>,
}

impl WalShippingService {
    pub fn new(node: Arc<ReplicationNode>) -> WalShippingService {
        WalShippingService { node }
    }
}

type SegmentStream = Pin<Box<dyn Stream<Item = Result<ShipSegmentRequest, Status>> + Send>>;

#[tonic::async_trait]
impl WalShipping for WalShippingService {
    async fn ship_segment(
        &self,
        request: Request<ShipSegmentRequest>,
    ) -> Result<Response<ShipSegmentResponse>, Status> {
        let request = request.into_inner();
        let applied = self.node.apply_inbound(&request, Source::Push).await?;
        let epoch =
            self.node.replica(request.id.unwrap_or_default().shard_id).map_or(0, |r| r.epoch.max(request.epoch));
        Ok(Response::new(ShipSegmentResponse { accepted: true, applied_seqno: applied, epoch }))
    }

    type StreamSegmentsStream = SegmentStream;

    async fn stream_segments(&self, request: Request<StreamRequest>) -> Result<Response<SegmentStream>, Status> {
        let rx = self.node.stream_segments(request.into_inner())?;
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn heartbeat(&self, request: Request<HeartbeatRequest>) -> Result<Response<HeartbeatResponse>, Status> {
        self.node.on_heartbeat(request.get_ref())?;
        Ok(Response::new(HeartbeatResponse { acknowledged: true }))
    }
}
