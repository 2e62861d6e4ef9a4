//! The node's gRPC port serves `grpc.health.v1` and server reflection, so
//! standard tools (grpcurl, load balancers' health checks) work unmodified.

mod common;

use common::NodeProcess;
use tonic::transport::Endpoint;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_reflection::pb::v1::ServerReflectionRequest;
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_and_reflection() {
    let dir = tempfile::tempdir().unwrap();
    let node = NodeProcess::start(1, dir.path(), "1", &[]);
    let channel = Endpoint::from_shared(format!("http://{}", node.grpc)).unwrap().connect().await.unwrap();

    let mut health = HealthClient::new(channel.clone());
    let status = |service: &str| HealthCheckRequest { service: service.to_string() };
    let serving = health.check(status("walship.v1.Log")).await.unwrap().into_inner().status;
    assert_eq!(serving, ServingStatus::Serving as i32);
    let unknown = health.check(status("no.such.Service")).await.unwrap_err();
    assert_eq!(unknown.code(), tonic::Code::NotFound);

    let mut reflection = ServerReflectionClient::new(channel);
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut responses = reflection.server_reflection_info(futures::stream::iter([request])).await.unwrap().into_inner();
    let response = responses.message().await.unwrap().expect("one response");
    let Some(MessageResponse::ListServicesResponse(list)) = response.message_response else {
        panic!("unexpected reflection answer: {response:?}");
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    for expected in ["walship.v1.Log", "grpc.health.v1.Health"] {
        assert!(names.iter().any(|n| n == expected), "{expected} missing from {names:?}");
    }
}
