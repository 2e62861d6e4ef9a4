//! The coordinator's gRPC face: nodes send it `WalShipping.Heartbeat`;
//! shipping RPCs are refused (a coordinator holds no shard).

use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use tonic::{Request, Response, Status};
use walship_proto::replication::wal_shipping_server::WalShipping;
use walship_proto::replication::{
    HeartbeatBatchRequest, HeartbeatRequest, HeartbeatResponse, ShipBatch, ShipBatchAnswer, ShipSegmentRequest,
    ShipSegmentResponse, StreamRequest,
};

use crate::control::Coordinator;

#[derive(Clone)]
pub struct CoordinatorHeartbeats {
    coordinator: Arc<Coordinator>,
}

impl CoordinatorHeartbeats {
    pub fn new(coordinator: Arc<Coordinator>) -> CoordinatorHeartbeats {
        CoordinatorHeartbeats { coordinator }
    }
}

type SegmentStream = Pin<Box<dyn Stream<Item = Result<ShipSegmentRequest, Status>> + Send>>;

fn not_a_node() -> Status {
    Status::failed_precondition("this is a coordinator: it holds no shard replicas")
}

#[tonic::async_trait]
impl WalShipping for CoordinatorHeartbeats {
    async fn ship_segment(&self, _: Request<ShipSegmentRequest>) -> Result<Response<ShipSegmentResponse>, Status> {
        Err(not_a_node())
    }

    type ShipSegmentsStream = Pin<Box<dyn Stream<Item = Result<ShipSegmentResponse, Status>> + Send>>;

    async fn ship_segments(
        &self,
        _: Request<tonic::Streaming<ShipSegmentRequest>>,
    ) -> Result<Response<Self::ShipSegmentsStream>, Status> {
        Err(not_a_node())
    }

    type ShipBatchesStream = Pin<Box<dyn Stream<Item = Result<ShipBatchAnswer, Status>> + Send>>;

    async fn ship_batches(
        &self,
        _: Request<tonic::Streaming<ShipBatch>>,
    ) -> Result<Response<Self::ShipBatchesStream>, Status> {
        Err(not_a_node())
    }

    type StreamSegmentsStream = SegmentStream;

    async fn stream_segments(&self, _: Request<StreamRequest>) -> Result<Response<SegmentStream>, Status> {
        Err(not_a_node())
    }

    async fn heartbeat(&self, request: Request<HeartbeatRequest>) -> Result<Response<HeartbeatResponse>, Status> {
        self.coordinator.on_heartbeat(request.get_ref())?;
        Ok(Response::new(HeartbeatResponse { acknowledged: true }))
    }

    async fn heartbeat_batch(
        &self,
        request: Request<HeartbeatBatchRequest>,
    ) -> Result<Response<HeartbeatResponse>, Status> {
        self.coordinator.on_heartbeat_batch(request.into_inner())?;
        Ok(Response::new(HeartbeatResponse { acknowledged: true }))
    }

    async fn node_keepalive(
        &self,
        _: Request<walship_proto::replication::NodeKeepaliveRequest>,
    ) -> Result<Response<walship_proto::replication::NodeKeepaliveResponse>, Status> {
        Err(not_a_node())
    }
}
