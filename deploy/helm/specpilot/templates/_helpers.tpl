{{- define "specpilot.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "specpilot.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "specpilot.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "specpilot.tokenSecret" -}}
{{- .Values.policyToken.existingSecret | default (printf "%s-token" (include "specpilot.fullname" .)) -}}
{{- end -}}

{{/* The name TLS clients check the controller's certificate for (tls.serverName). */}}
{{- define "specpilot.tlsServerName" -}}
{{- .Values.tls.serverName | default (printf "%s.%s.svc" (include "specpilot.fullname" .) .Release.Namespace) -}}
{{- end -}}

{{/* Where the engine connects: the mTLS engine port with tls.engineClientAuth, else gRPC. */}}
{{- define "specpilot.engineTarget" -}}
{{- if and .Values.tls.enabled .Values.tls.engineClientAuth -}}
127.0.0.1:{{ .Values.tls.engineGrpcPort }}
{{- else -}}
127.0.0.1:{{ .Values.controller.grpcPort }}
{{- end -}}
{{- end -}}

{{/* The checks no schema can express; each names the value to change. */}}
{{- define "specpilot.checks" -}}
{{- if and .Values.sidecar.native (not (semverCompare ">=1.29.0-0" .Capabilities.KubeVersion.Version)) -}}
{{- fail (printf "sidecar.native=true needs Kubernetes >= 1.29 (native sidecars); this cluster is %s: set sidecar.native=false" .Capabilities.KubeVersion.Version) -}}
{{- end -}}
{{- if and .Values.redis.enabled (not (or .Values.redis.url .Values.redis.existingSecret)) -}}
{{- fail "redis.enabled=true needs redis.url or redis.existingSecret" -}}
{{- end -}}
{{- if and .Values.tls.enabled (not .Values.tls.secretName) -}}
{{- fail "tls.enabled=true needs tls.secretName: a kubernetes.io/tls Secret with tls.crt, tls.key and the CA under tls.caKey" -}}
{{- end -}}
{{- if and .Values.tls.engineClientAuth (not .Values.tls.enabled) -}}
{{- fail "tls.engineClientAuth=true needs tls.enabled=true (client certificates are asked for over TLS)" -}}
{{- end -}}
{{- if and .Values.tls.enabled .Values.tls.engineClientAuth (has (int .Values.tls.engineGrpcPort) (list (int .Values.controller.grpcPort) (int .Values.controller.httpPort))) -}}
{{- fail "tls.engineGrpcPort must differ from controller.grpcPort and controller.httpPort" -}}
{{- end -}}
{{- if and .Values.metrics.serviceMonitor.enabled .Values.metrics.podMonitor.enabled -}}
{{- fail "metrics.serviceMonitor.enabled and metrics.podMonitor.enabled are both true: enable one (each would scrape the controller)" -}}
{{- end -}}
{{- end -}}

{{- define "specpilot.controllerContainer" -}}
- name: specpilot
  image: "{{ .Values.controller.image.repository }}:{{ .Values.controller.image.tag }}"
  imagePullPolicy: {{ .Values.controller.image.pullPolicy }}
  {{- if .Values.sidecar.native }}
  restartPolicy: Always
  {{- end }}
  args: ["serve", "--config", "/etc/specpilot/specpilot.yaml", "--log-level", {{ .Values.controller.logLevel | quote }}]
  env:
    - name: SPECPILOT_POLICY_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ include "specpilot.tokenSecret" . }}
          key: {{ .Values.policyToken.key }}
    - name: SPECPILOT_ENGINE_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ include "specpilot.tokenSecret" . }}
          key: {{ .Values.policyToken.engineKey }}
    - name: SPECPILOT_SIDECAR_ID
      valueFrom:
        fieldRef:
          fieldPath: metadata.name
    {{- if .Values.redis.enabled }}
    - name: SPECPILOT_STATE_STORE
      {{- if .Values.redis.existingSecret }}
      valueFrom:
        secretKeyRef:
          name: {{ .Values.redis.existingSecret }}
          key: {{ .Values.redis.existingSecretKey }}
      {{- else }}
      value: {{ .Values.redis.url | quote }}
      {{- end }}
    {{- end }}
  ports:
    - name: grpc
      containerPort: {{ .Values.controller.grpcPort }}
    - name: http-metrics
      containerPort: {{ .Values.controller.httpPort }}
    {{- if and .Values.tls.enabled .Values.tls.engineClientAuth }}
    - name: grpc-engine
      containerPort: {{ .Values.tls.engineGrpcPort }}
    {{- end }}
  {{- /* The kubelet's gRPC probes cannot speak TLS (before Kubernetes 1.37's alpha): with TLS,
  the probes are HTTPS GETs of /healthz (the kubelet skips certificate verification), which the
  same process answers; no exec, so no Python process per probe in the container's memory. */}}
  {{- $probe := printf "grpc: {port: %d}" (int .Values.controller.grpcPort) }}
  {{- if .Values.tls.enabled }}
  {{- $probe = "httpGet: {path: /healthz, port: http-metrics, scheme: HTTPS}" }}
  {{- end }}
  startupProbe:
    {{ $probe }}
    periodSeconds: 2
    failureThreshold: 30
  livenessProbe:
    {{ $probe }}
    periodSeconds: 10
    failureThreshold: 3
  readinessProbe:
    {{ $probe }}
    periodSeconds: 5
  resources:
    {{- toYaml .Values.controller.resources | nindent 4 }}
  securityContext:
    runAsNonRoot: true
    allowPrivilegeEscalation: false
    readOnlyRootFilesystem: true
    capabilities: {drop: [ALL]}
  volumeMounts:
    - name: specpilot-config
      mountPath: /etc/specpilot
      readOnly: true
    {{- if .Values.tls.enabled }}
    - name: specpilot-tls
      mountPath: /etc/specpilot-tls
      readOnly: true
    {{- end }}
{{- end -}}
