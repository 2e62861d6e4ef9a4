//! Child processes that never outlive the harness, and loopback ports.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// A server process. Dropping it sends `stop_signal`, waits up to ten
/// seconds, then kills it.
pub struct Server {
    pub name: String,
    child: Option<Child>,
    stop_signal: i32,
}

impl Server {
    /// Starts `command` with stdout/stderr appended to `log`.
    pub fn spawn(name: &str, mut command: Command, log: &Path, stop_signal: i32) -> Result<Server> {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| format!("opening {}", log.display()))?;
        let child = command
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        Ok(Server { name: name.to_string(), child: Some(child), stop_signal })
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, |c| c.id())
    }

    /// Fails if the process has already exited.
    pub fn check_running(&mut self) -> Result<()> {
        if let Some(child) = &mut self.child
            && let Some(status) = child.try_wait()?
        {
            bail!("{} exited: {status}", self.name);
        }
        Ok(())
    }

    /// Kills the process at once (SIGKILL, a crash) and waits for it.
    pub fn kill(&mut self) -> Result<()> {
        let Some(mut child) = self.child.take() else { return Ok(()) };
        child.kill()?;
        child.wait()?;
        Ok(())
    }

    /// Stops the process and waits for it.
    pub fn stop(&mut self) -> Result<()> {
        let Some(mut child) = self.child.take() else { return Ok(()) };
        // SAFETY: signalling our own child by its PID.
        unsafe { libc::kill(child.id() as i32, self.stop_signal) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if child.try_wait()?.is_some() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        child.kill()?;
        child.wait()?;
        bail!("{} did not stop within 10 s and was killed", self.name)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

/// A loopback port nobody is listening on right now.
pub fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// `n` different free loopback ports, for one cluster whose processes bind
/// them later: probing one at a time can hand out the same port twice.
pub fn distinct_ports(n: usize) -> Result<Vec<u16>> {
    let mut ports = Vec::with_capacity(n);
    while ports.len() < n {
        let port = free_port()?;
        if !ports.contains(&port) {
            ports.push(port);
        }
    }
    Ok(ports)
}

/// Waits until something accepts TCP connections on `addr`.
pub fn wait_for_port(addr: SocketAddr, timeout: Duration, server: &mut Server) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
            // Someone listens; make sure it is not another process on a
            // port this one failed to bind.
            return server.check_running();
        }
        server.check_running()?;
        if Instant::now() > deadline {
            bail!("{} (pid {}) did not listen on {addr} within {timeout:?}", server.name, server.pid());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
