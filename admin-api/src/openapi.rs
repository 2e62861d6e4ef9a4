//! The OpenAPI 3 documents of the two admin APIs, generated from the
//! handlers' annotations and the models' derives. Checked in under
//! `ops/openapi/`; a test fails when the checked-in copy is stale.

use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use crate::drills::DrillStarted;
use crate::models::{
    ClusterView, CoordinatorView, ErrorBody, ErrorDetail, LagHistoryView, LagSample, LagSeries, NodeStatus, NodeView,
    ReplicaView, ShardView,
};

struct Bearer;

/// `NewTask`'s and `ReplicaChangeRequest`'s variants refuse unknown fields (serde's
/// `deny_unknown_fields`); utoipa does not say so for an internally tagged
/// enum's variants, so this closes them (`additionalProperties: false`).
struct ClosedNewTask;

impl Modify for ClosedNewTask {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::RefOr;
        use utoipa::openapi::schema::{AdditionalProperties, Schema};
        let Some(components) = openapi.components.as_mut() else { return };
        // Bodies chosen by a tag, each refusing unknown fields.
        for tagged in ["NewTask", "ReplicaChangeRequest"] {
            let Some(RefOr::T(Schema::OneOf(one_of))) = components.schemas.get_mut(tagged) else { continue };
            for item in &mut one_of.items {
                if let RefOr::T(Schema::Object(object)) = item {
                    object.additional_properties = Some(Box::new(AdditionalProperties::FreeForm(false)));
                }
            }
        }
    }
}

impl Modify for Bearer {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

#[derive(OpenApi)]
#[openapi(
    info(title = "walship coordinator admin API", description = "Cluster, shards, failover, drills and DataPlane tasks. Mutating endpoints need a bearer token."),
    paths(
        crate::coord::healthz, crate::coord::readyz, crate::coord::metrics, crate::coord::openapi,
        crate::coord::cluster, crate::coord::shards, crate::coord::shard, crate::leadership::failover, crate::leadership::rebalance,
        crate::coord::lag_history, crate::replicas::start, crate::replicas::list, crate::replicas::show,
        crate::drills::drills, crate::drills::drill, crate::drills::failover_drill, crate::drills::catchup_drill,
        crate::drills::corruption_drill, crate::drills::partition_drill, crate::drills::reseed_drill,
        crate::tasks::list, crate::tasks::show, crate::tasks::start, crate::tasks::cancel,
        crate::tasks::dead_letters, crate::tasks::redrive, crate::tasks::job, crate::tasks::export_file,
    ),
    components(schemas(
        ClusterView, CoordinatorView, NodeView, ShardView, ReplicaView, ErrorBody, ErrorDetail, DrillStarted,
        LagHistoryView, LagSeries, LagSample,
        walship_shipping::control::state::FailoverRecord,
        walship_shipping::control::FailoverRequest, walship_shipping::control::FailoverOutcome,
        walship_shipping::control::coordinator::CandidatePreview,
        walship_shipping::control::coordinator::RebalanceRequest, walship_shipping::control::coordinator::RebalanceOutcome,
        walship_shipping::control::coordinator::RebalanceMove,
        walship_shipping::control::drills::FailoverDrillRequest, walship_shipping::control::drills::CatchupDrillRequest,
        walship_shipping::control::drills::DrillReport, walship_shipping::control::drills::FailoverDrillResult,
        walship_shipping::control::drills::CatchupDrillResult,
        walship_shipping::control::drills::CorruptionDrillRequest, walship_shipping::control::drills::CorruptionDrillResult,
        walship_shipping::control::drills::PartitionDrillRequest, walship_shipping::control::drills::PartitionDrillResult,
        walship_shipping::control::drills::PartitionTrial, walship_shipping::control::drills::TimeSummary,
        walship_shipping::control::drills::ReseedDrillRequest, walship_shipping::control::drills::ReseedDrillResult,
        walship_shipping::control::drills::ReseedSource,
        walship_shipping::control::coordinator::ReplicaChangeRequest, walship_shipping::control::coordinator::ReplicaChange,
        walship_shipping::control::coordinator::ReplicaAction,
        crate::tasks::TaskView, crate::tasks::TaskPage, crate::tasks::CancelBroadcast, crate::jobs::VerifySchedule, crate::jobs::ScheduledVerify, crate::tasks::NewTask, crate::tasks::TaskStarted, crate::tasks::JobView,
        walship_dataplane::kinds::verify::VerifyReport, walship_dataplane::kinds::export::ExportReport,
        walship_dataplane::task::TaskState, walship_dataplane::bus::DeadLetter,
        walship_dataplane::coordinator::WorkerView, crate::models::DataPlaneView,
    )),
    modifiers(&Bearer, &ClosedNewTask),
)]
struct CoordinatorDoc;

#[derive(OpenApi)]
#[openapi(
    info(title = "walship node admin API", description = "A node's health, metrics and replica status."),
    paths(crate::healthz, crate::readyz, crate::metrics, crate::status, crate::openapi),
    components(schemas(
        NodeStatus,
        ErrorBody,
        ErrorDetail,
        walship_shipping::replica::ReplicaStatus,
        walship_shipping::replica::FollowerStatus,
        walship_shipping::replica::CorruptRangeStatus,
        walship_shipping::replica::ProducersStatus,
        walship_shipping::replica::ReceivedHeartbeat,
        crate::models::DiskStatus,
        crate::models::WalIndexStatus,
        crate::models::WorkerStatus
    ))
)]
struct NodeDoc;

/// The coordinator's document.
pub fn coordinator() -> utoipa::openapi::OpenApi {
    CoordinatorDoc::openapi()
}

/// A node's document.
pub fn node() -> utoipa::openapi::OpenApi {
    NodeDoc::openapi()
}

#[cfg(test)]
mod tests {
    /// `ops/openapi/*.json` must be what the code generates: regenerate with
    /// `WALSHIP_WRITE_OPENAPI=1 cargo test -p walship-admin-api openapi`.
    #[test]
    fn checked_in_openapi_documents_are_current() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../ops/openapi");
        for (name, doc) in [("coordinator.json", super::coordinator()), ("node.json", super::node())] {
            let generated = doc.to_pretty_json().unwrap() + "\n";
            let path = dir.join(name);
            if std::env::var_os("WALSHIP_WRITE_OPENAPI").is_some() {
                std::fs::create_dir_all(&dir).unwrap();
                std::fs::write(&path, &generated).unwrap();
            }
            let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
            assert!(
                checked_in == generated,
                "ops/openapi/{name} is stale: run WALSHIP_WRITE_OPENAPI=1 cargo test -p walship-admin-api openapi"
            );
        }
    }
}
